"""The tiny model's packs as a paged-attention engine's connector sees them, without an engine: a store of two packs
(``wexley``, ``oslo``) and the tiny model as the engine serves it, which tests/unit/test_vllm_*.py plan against."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from packstore.answering.paged import ServedModel
from packstore.kv.build import build_pack
from packstore.kv.render import render
from packstore.packs.tensors import encode_pack
from packstore.store.lmdb.store import LmdbStore

FACTS = ["The river Tamsin flows through the town of Wexley.", "Wexley is famous for its bells.", "Alice lives in Paris and works as a baker."]
OTHER = ["Bob lives in Oslo.", "The quick brown fox jumps over the lazy dog."]
BLOCK = 4


@contextmanager
def paged_packs(path: Path, tiny_lm: Any) -> Iterator[tuple[LmdbStore, ServedModel]]:
    """A store at ``path`` with the packs ``wexley`` (``FACTS``) and ``oslo`` (``OTHER``), opened read-only, and the
    tiny model as an engine with blocks of ``BLOCK`` tokens serves it."""
    with LmdbStore(path) as store:
        for name, facts in (("wexley", FACTS), ("oslo", OTHER)):
            store.put(encode_pack(build_pack(tiny_lm, facts)), name=name)
    config = tiny_lm.model.config
    served = ServedModel(
        model_fp=tiny_lm.model_fp,
        template_fp=tiny_lm.template_fp,
        dtype="float32",
        layers=config.num_hidden_layers,
        kv_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        block_size=BLOCK,
    )
    with LmdbStore(path, readonly=True) as store:
        yield store, served


def prompt(tiny_lm: Any, facts: list[str], question: str = "Who lives in Oslo?") -> list[int]:
    return render(tiny_lm.tokenizer, facts, question).token_ids
