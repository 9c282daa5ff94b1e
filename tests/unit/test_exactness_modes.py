"""packstore.kv.exactness: the exactness modes (deterministic algorithms, one pinned attention backend) set torch's
flags for a block or for the process, restore them, and are what a pack built under one records in ``built_on``; on CPU
a mode builds and answers bit for bit as the default does its own (both are exact there)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from packstore.errors import InvalidInput
from packstore.format.header import EXACTNESS_MODES
from packstore.kv import exactness as exactness_module
from packstore.kv.build import build_pack, cache_tensors, prefill
from packstore.kv.exactness import Mode, apply, current, exactness, machine
from packstore.kv.inject import Sampling, answer_with_pack, answer_with_text


def flags() -> tuple:
    matmul = torch.backends.cuda.matmul
    return (
        torch.are_deterministic_algorithms_enabled(), matmul.allow_bf16_reduced_precision_reduction,
        matmul.allow_fp16_reduced_precision_reduction, os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
        torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled(),
    )


@pytest.fixture
def restored():
    """Whatever a test sets process-wide (``apply``) is undone after it."""
    saved = exactness_module._settings()  # torch's flags and CUBLAS_WORKSPACE_CONFIG
    yield
    exactness_module._restore(saved)
    exactness_module._current[0] = "default"


@pytest.mark.parametrize("name", EXACTNESS_MODES)
def test_every_mode_parses_to_its_own_name(name: str) -> None:
    assert Mode.parse(name).name == name


def test_an_unknown_mode_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(InvalidInput, match=re.escape("unknown exactness mode 'sdpa-math+deterministic': use one of default, deterministic,")):
        Mode.parse("sdpa-math+deterministic")  # one spelling per mode, as the header has it


def test_a_block_sets_the_flags_and_restores_them(monkeypatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = flags()
    with exactness("deterministic+sdpa-math") as mode:
        assert mode == Mode(deterministic=True, sdpa="math") and current() == "deterministic+sdpa-math"
        assert flags() == (True, False, False, ":4096:8", True, False, False, False)
        with exactness("sdpa-flash"):  # a block within a block: the inner mode, then the outer one again
            assert current() == "sdpa-flash" and flags()[4:] == (False, False, True, False)
        assert current() == "deterministic+sdpa-math" and flags()[4:] == (True, False, False, False)
    assert flags() == before and current() == "default"
    with pytest.raises(RuntimeError), exactness("deterministic"):
        raise RuntimeError("a failing build")
    assert flags() == before and current() == "default"


def test_apply_sets_a_mode_for_the_process(restored) -> None:
    apply("sdpa-math")
    assert current() == "sdpa-math" and flags()[4:] == (True, False, False, False)
    assert machine(torch.device("cpu"))["exactness"] == "sdpa-math"
    with pytest.raises(InvalidInput):
        apply("fast")


def test_a_pack_built_under_a_mode_records_it_and_answers_as_its_text_there(tiny_lm) -> None:
    facts = ["The river Tamsin flows through the town of Wexley.", "Wexley is famous for its bells."]
    greedy = Sampling(max_new_tokens=12)
    with exactness("deterministic+sdpa-math"):
        pack = build_pack(tiny_lm, facts)
        assert pack.header.built_on == {**machine(torch.device("cpu")), "dtype": "float32"}
        assert pack.header.built_on["exactness"] == "deterministic+sdpa-math"
        keys, values = cache_tensors(prefill(tiny_lm, pack.header.token_ids, boundaries=pack.header.prefill_chunks))
        assert all(torch.equal(a, b) for a, b in zip(pack.keys + pack.values, keys + values))
        answer = answer_with_pack(tiny_lm, pack, "Which river flows through Wexley?", greedy)
        assert answer.token_ids == answer_with_text(tiny_lm, facts, "Which river flows through Wexley?", sampling=greedy).token_ids
    assert "exactness" not in build_pack(tiny_lm, facts).header.built_on  # the default is written as its absence


def test_a_worker_refuses_an_unknown_mode_before_loading_its_model(tmp_path, monkeypatch) -> None:
    from packstore.store import StoreSpec
    from packstore.worker import server
    from packstore.worker.config import WorkerConfig
    from packstore.worker.server import run_worker

    monkeypatch.setattr(server, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(InvalidInput, match="unknown exactness mode 'fast'"):
        run_worker(WorkerConfig(model="smollm2-135m", store=StoreSpec.of(tmp_path / "store"), exactness="fast", reserve_memory=False))
