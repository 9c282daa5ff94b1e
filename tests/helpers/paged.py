"""The tiny test model as a paged-attention engine serves it, and stores of its packs, for the vLLM connector's
engine-free tests: most plan against ``paged_packs``, two packs (``wexley``, ``oslo``) in blocks of ``BLOCK`` tokens."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from packstore.answering.paged import ServedModel
from packstore.kv.build import build_pack
from packstore.kv.render import preamble_tokens, render
from packstore.packs.tensors import encode_pack
from packstore.store.lmdb.store import LmdbStore

FACTS = ["The river Tamsin flows through the town of Wexley.", "Wexley is famous for its bells.", "Alice lives in Paris and works as a baker."]
OTHER = ["Bob lives in Oslo.", "The quick brown fox jumps over the lazy dog."]
BLOCK = 4


def served_tiny(tiny_lm: Any, block_size: int, engine_version: str | None = None) -> ServedModel:
    """The tiny model served in float32 with ``block_size``-token cache blocks (by vLLM ``engine_version``, if given)."""
    config = tiny_lm.model.config
    return ServedModel(
        model_fp=tiny_lm.model_fp,
        template_fp=tiny_lm.template_fp,
        dtype="float32",
        layers=config.num_hidden_layers,
        kv_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        block_size=block_size,
        engine_version=engine_version,
        preamble_tokens=preamble_tokens(tiny_lm.tokenizer),
    )


def store_packs(path: Path, tiny_lm: Any, packs: Mapping[str, Sequence[str]]) -> Path:
    """An LMDB store at ``path`` holding, for each name, the tiny model's pack of its facts."""
    with LmdbStore(path) as store:
        for name, facts in packs.items():
            store.put(encode_pack(build_pack(tiny_lm, facts)), name=name)
    return path


@contextmanager
def paged_packs(path: Path, tiny_lm: Any) -> Iterator[tuple[LmdbStore, ServedModel]]:
    """A store at ``path`` with the packs ``wexley`` (``FACTS``) and ``oslo`` (``OTHER``), opened read-only, and the
    tiny model as an engine with blocks of ``BLOCK`` tokens serves it."""
    store_packs(path, tiny_lm, {"wexley": FACTS, "oslo": OTHER})
    with LmdbStore(path, readonly=True) as store:
        yield store, served_tiny(tiny_lm, BLOCK)


def prompt(tiny_lm: Any, facts: Sequence[str], question: str = "Who lives in Oslo?") -> list[int]:
    """The token ids of ``facts`` then ``question`` rendered with the tiny model's template."""
    return render(tiny_lm.tokenizer, list(facts), question).token_ids
