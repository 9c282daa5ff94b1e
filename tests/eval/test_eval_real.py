"""The evaluations of tools/eval/ end to end on smollm2-135m, each a short version of its `make eval-*` run: every part
on few questions and few tokens, outputs written, 0 divergences."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.eval import eval_packs  # noqa: E402

pytestmark = [pytest.mark.eval, pytest.mark.model]
ROWS = 3


def test_eval_packs_on_smollm2(tmp_path: Path, capsys, shared_model) -> None:
    """The first ckc rows, 16 tokens each way (the first row's answer, with the paragraph in the prompt, is in its first 8)."""
    shared_model(eval_packs)
    out, figures = tmp_path / "out", tmp_path / "figures"
    argv = ["--models", "smollm2-135m", "--limit", str(ROWS), "--max-new-tokens", "16", "--out", str(out), "--figures", str(figures), "--prompt", "open"]
    assert eval_packs.main(argv) == 0
    assert f"divergences (b) vs (c): 0 of {ROWS}" in capsys.readouterr().out
    records = [json.loads(line) for line in (out / "questions.jsonl").read_text().splitlines()]
    assert len(records) == ROWS and not any(r["divergent"] for r in records)
    for record in records:
        conditions = record["conditions"]
        assert conditions["pack"]["prompt_tokens"] + record["pack_tokens"] == conditions["text"]["prompt_tokens"]
        assert conditions["pack"]["prompt_tokens"] < conditions["none"]["prompt_tokens"]
    # The paragraphs hold the (substituted) answers: text in the prompt must answer some of them (smollm2-135m
    # answers in sentences, so the lenient metric; with the bare question, as the first rows' answers were checked).
    assert sum(r["conditions"]["text"]["contains"] for r in records) >= 1
    assert all(r["prompt"] == "open" and set(r["conditions"]["text"]) >= {"contains", "f1"} for r in records)
    assert {p.name for p in figures.iterdir()} == {"eval_packs_accuracy.png", "eval_packs_prompt_tokens.png"}


def test_eval_compose_on_smollm2(tmp_path: Path, capsys, shared_model) -> None:
    """The short version of `make eval-compose`: every part on a few questions (modes and diagnosis on one, compose time at 256
    tokens), 6 new tokens, 0 divergences."""
    from tools.eval import eval_compose

    shared_model(eval_compose)
    out, figures = tmp_path / "out", tmp_path / "figures"
    argv = ["--models", "smollm2-135m", "--limit", "1", "--acc-limit", "2", "--acc-golds", "2", "--acc-distractors", "1", "--errata", "2"]
    argv += ["--diag-limit", "1", "--timing-tokens", "256", "--timing-repeats", "1", "--max-new-tokens", "6", "--out", str(out), "--figures", str(figures)]
    assert eval_compose.main(argv) == 0
    capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())["parts"]
    accumulation = summary["accumulation"]["smollm2-135m"]
    assert sorted(accumulation) == ["1", "2", "3"] and all(s["divergences"] == 0 for s in accumulation.values())
    assert accumulation["3"]["gold_included"] == 1.0 and accumulation["1"]["gold_included"] < 1.0  # 2 questions, 3 parts
    assert accumulation["3"]["savings"] > 0.8 and accumulation["3"]["prefilled_tokens"] < accumulation["3"]["composed_tokens"]
    modes = summary["modes"]["smollm2-135m"]
    assert modes["questions"] == 1 and modes["agreement"]["rope"]["prob_cosine"]["mean"] > 0
    timing = summary["timing"]["smollm2-135m"]["256"]
    assert timing["same_token_ids"] and timing["prefilled_tokens"]["rope"] < timing["prefilled_tokens"]["exact"]
    assert summary["errata"]["smollm2-135m"]["divergences"] == 0
    diagnosis = summary["diagnosis"]["smollm2-135m"]  # every layer of smollm2 has full attention: that patch is exact
    assert diagnosis["none"]["questions"] == 1 and diagnosis["full"]["answer_kl"]["mean"] < 1e-6 and "sliding" not in diagnosis
    assert {p.name for p in figures.iterdir()} == {
        "eval_compose_accumulation.png", "eval_compose_modes.png", "eval_compose_errata.png"
    }


# One condition of each kind: every part, direction, layer range and target, and an instruction (the tiny-model run of
# tests/eval/test_eval_steering.py asks all of them); the references the parts compare with run anyway.
STEERING_CONDITIONS = ("instruction happy", "sentiment +1 early", "sentiment-5a +1", "food +1", "sentiment +1 food +1", "keys +1", "both +1",
                       "keys before RoPE +1", "sentiment mean-pooled +1", "sentiment chat-framed +1", "sentiment all layers +1")


def test_eval_steering_on_smollm2(tmp_path: Path, capsys, shared_model) -> None:
    """The short version of `make eval-steering`: every part on one prompt a set (a left-padded batch of two, then one),
    one condition of each kind, directions from 6 pairs each, one dual-channel question unsteered and steered."""
    from tools.eval import eval_steering

    shared_model(eval_steering)
    out, figures = tmp_path / "out", tmp_path / "figures"
    argv = ["--models", "smollm2-135m", "--limit", "1", "--dual-limit", "1", "--compare", "1", "--batch", "2", "--pairs", "6"]
    argv += ["--conditions", ",".join(STEERING_CONDITIONS), "--dual-alphas", "0", "1"]
    argv += ["--max-new-tokens", "4", "--dual-max-new-tokens", "10", "--out", str(out), "--figures", str(figures)]
    assert eval_steering.main(argv) == 0
    capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    by_condition = summary["generations"]["smollm2-135m"]
    assert set(by_condition) == set(STEERING_CONDITIONS) | set(eval_steering.REFERENCES)
    assert all(by_condition[c]["all"]["n"] == 3 for c in by_condition)  # 1 prompt x 3 sets

    def kinds(found: list) -> tuple[set, ...]:  # the 5-pair subsets b and c take a's path, the late third the early one's
        return ({c.part for c in found}, {n for c in found for n, _ in c.steer if n[-2:] not in ("5b", "5c")},
                {c.layers for c in found if c.layers != "late"}, {c.target for c in found}, {bool(c.instruction) for c in found},
                {len(c.steer) for c in found})

    assert kinds([c for c in eval_steering.conditions() if c.name in by_condition]) == kinds(eval_steering.conditions())
    dual = summary["dual"]["smollm2-135m"]
    assert sorted(map(float, dual)) == [0.0, 1.0]
    assert all(s["compared"] == 1 and s["divergences"] == 0 for s in dual.values())  # steered pack = steered text
    [cosines] = summary["cosines"]
    assert cosines["layers"] == 30 and len(cosines["cosines"]["sentiment vs food"]) == 30
    assert all(null["shuffles"] == eval_steering.NULL_SHUFFLES for null in cosines["null"].values())
    assert {p.name for p in figures.iterdir()} == {
        "eval_steering_alpha.png", "eval_steering_layers_pairs.png", "eval_steering_directions.png", "eval_steering_dual.png"
    }


def test_eval_exactness_quick_on_cpu(tmp_path: Path, capsys) -> None:
    """tools/eval/eval_exactness.py --quick: 2 packs x 2 held-out questions in float32 on CPU, in the default exactness
    mode and in deterministic algorithms with the math attention backend pinned (build and answers alike), every promised
    measure exact; the K/V compared is the pack the answers ran with; a shard asks its packs alone into a file of its
    own, and the table groups shards by dtype and variant."""
    import torch

    from packstore.kv.exactness import machine
    from tools.eval import eval_exactness

    argv = ["--quick", "--device", "cpu", "--dtypes", "float32", "--variants", "default,deterministic+sdpa-math"]
    assert eval_exactness.main([*argv, "--out", str(tmp_path), "--rev", "abc1234"]) == 0
    out = capsys.readouterr().out
    exact = "4/4 (100.0 % [51.0, 100.0])"  # with its Wilson interval
    assert f"| smollm2-135m | cpu | float32 | default | 4 | {exact} | {exact} | {exact} | {exact} | {exact} | - |" in out
    assert "| smollm2-135m | cpu | float32 | deterministic+sdpa-math | 4 |" in out
    records = [json.loads(line) for line in (tmp_path / "cpu-float32.json").read_text().splitlines()]
    assert len(records) == 4 and all(r["chunked_identical"] is True and r["prefill_chunks"][-1] == r["pack_tokens"] for r in records)
    assert all(r["kv_bit_equal"] is True and r["repeat_identical"] is True and r["commit"] == "abc1234" for r in records)
    assert all(r["kv_source"] == "answer" and r["kv_first_diff_layer"] is None and r["prefill_s"] > 0 for r in records)
    assert all(r["variant"] == "default" and r["built_on"] == {**machine(torch.device("cpu")), "dtype": "float32"} for r in records)
    strict = [json.loads(line) for line in (tmp_path / "cpu-float32-deterministic_sdpa-math.json").read_text().splitlines()]
    assert len(strict) == 4 and all(r["variant"] == "deterministic+sdpa-math" and r["cublas_workspace_config"] == ":4096:8" for r in strict)
    assert all(r["built_on"]["exactness"] == "deterministic+sdpa-math" for r in strict)  # the pack says how it was computed
    assert all(r["chunked_identical"] is True and r["kv_bit_equal"] is True and r["kv_source"] == "answer" for r in strict)
    assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cuda.flash_sdp_enabled()  # restored after
    shards = tmp_path / "shards"
    assert eval_exactness.main(["--quick", "--device", "cpu", "--dtypes", "float32", "--out", str(shards), "--shard", "1/2"]) == 0
    second = [json.loads(line) for line in (shards / "cpu-float32.1of2.json").read_text().splitlines()]
    assert [r["id"] for r in second] == [r["id"] for r in records[2:]]
    grouped = eval_exactness.table([records[:2], second])
    assert "| smollm2-135m | cpu | float32 | default | 4 |" in grouped


def test_eval_exactness_on_a_random_shape_records_a_failing_variant(tmp_path: Path, capsys) -> None:
    """--shape tiny: bench_gpu's tiny Llama geometry with random weights, made with smollm2's tokenizer; a variant that
    cannot run here (the memory-efficient attention backend alone, which CPU attention lacks) is recorded with its
    error and the run goes on."""
    from tools.eval import eval_exactness

    argv = ["--quick", "--shape", "tiny", "--models", str(tmp_path / "models"), "--device", "cpu", "--dtypes", "float32"]
    assert eval_exactness.main([*argv, "--variants", "sdpa-math,sdpa-efficient", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "| random-tiny | cpu | float32 | sdpa-math | 4 |" in out and "random-tiny cpu float32 sdpa-efficient: failed: RuntimeError" in out
    [failure] = [json.loads(line) for line in (tmp_path / "out" / "cpu-float32-sdpa-efficient.json").read_text().splitlines()]
    assert failure["variant"] == "sdpa-efficient" and failure["error"].startswith("RuntimeError")
    records = [json.loads(line) for line in (tmp_path / "out" / "cpu-float32-sdpa-math.json").read_text().splitlines()]
    assert len(records) == 4 and all(r["model"] == "random-tiny" and r["chunked_identical"] is True and r["kv_bit_equal"] for r in records)
    assert (tmp_path / "models" / "exactness-tiny-float32" / "config.json").exists()


def test_compare_kv_names_the_first_layer_whose_kv_differ(tiny_lm) -> None:
    from packstore.kv.build import build_pack, prefill
    from tools.eval.eval_exactness import compare_kv

    pack = build_pack(tiny_lm, ["The river Tamsin flows through Wexley."])
    reference = prefill(tiny_lm, pack.header.token_ids, boundaries=pack.header.prefill_chunks)
    assert compare_kv(pack, reference).fields() == {"kv_bit_equal": True, "kv_first_diff_layer": None, "kv_first_diff": None, "kv_max_abs_diff": 0.0}
    pack.values[1] = pack.values[1].clone()
    pack.values[1][0, 2, 3] += 0.5
    pack.keys[2] = pack.keys[2] * 1.001
    compared = compare_kv(pack, reference)
    assert (compared.bit_equal, compared.first_layer, compared.which) == (False, 1, "value") and 0.49 < compared.max_abs_diff < 1
