"""Fidelity on the real models shipped in wheels, over real questions from tools/data/ckc_dev.jsonl.

For each model: at least 20 questions over fact sets of at least 500 tokens, answered with the pack
injected and with the facts as prompt text; greedy outputs must be identical (0 divergences).
max |dK| and |dV| between standalone and joint prefill go into the fidelity report at the end of
the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from packstore.cli.packctl import main as packctl_main
from packstore.errors import PackMismatch
from packstore.format.body import BLOCK_POSITIONS
from packstore.kv.build import build_pack, prefill
from packstore.kv.inject import Sampling, answer_with_pack, answer_with_text, prefill_divergence
from packstore.kv.models import load_model
from packstore.packs.reader import PackReader
from packstore.packs.tensors import decode_pack, encode_pack
from packstore.store import LmdbStore
from tests.helpers.real_models import MIN_PACK_TOKENS, MIN_QUESTIONS, MODELS, eval_rows, fact_sets

pytestmark = pytest.mark.model

# Identity is checked token for token: a divergence shows within the first tokens of an answer, and 12 of them take a
# fraction of the time 24 took after prefills of 600 tokens (the fast lane's answer keeps 24, to reach the name).
GREEDY = Sampling(max_new_tokens=12)
REPO = Path(__file__).resolve().parents[2]


def exact_match(prediction: str, answers: list[str]) -> bool:
    return any(a.lower() in prediction.lower() for a in answers)


@pytest.fixture(scope="module", params=MODELS)
def real_lm(request, real_model):
    return real_model(request.param)



@pytest.mark.fast
def test_a_stored_pack_answers_as_its_facts_in_the_prompt(real_model, tmp_path: Path) -> None:
    """The fast lane's real-model answer: smollm2-135m, the README's example facts and first question, the pack stored
    and answered through the one answering path, token for token the answer with the facts as prompt text."""
    from packstore.answering.answer import Answerer, Question

    lm = real_model("smollm2-135m")
    facts = [line for line in (REPO / "examples" / "facts.txt").read_text().splitlines() if line.strip()]
    question = json.loads((REPO / "examples" / "questions.jsonl").read_text().splitlines()[0])["question"]
    with LmdbStore(tmp_path / "store") as store:
        store.put(encode_pack(build_pack(lm, facts)), name="velmora")
        result = Answerer(lm, store).ask(Question(question, refs=("velmora",), sampling=Sampling(max_new_tokens=24), compare_rag=True))
    assert result.identical is True and "Brandqvist" in result.answer, result.answer

def test_pack_injection_is_identical_to_text_in_prompt(real_lm, fidelity_report) -> None:
    rows = eval_rows()
    questions = divergences = pack_correct = 0
    worst_dk = worst_dv = 0.0
    for facts, group in fact_sets(real_lm.tokenizer, rows):
        pack = decode_pack(encode_pack(build_pack(real_lm, facts)))
        assert pack.header.tokens >= MIN_PACK_TOKENS
        for row in group:
            with_pack = answer_with_pack(real_lm, pack, row["question"], GREEDY)
            with_text = answer_with_text(real_lm, facts, row["question"], sampling=GREEDY)
            questions += 1
            divergences += with_pack.token_ids != with_text.token_ids
            pack_correct += exact_match(with_pack.text, row["answers"])
            assert with_pack.prompt_tokens + pack.header.tokens == with_text.prompt_tokens
        dk, dv = prefill_divergence(real_lm, pack, group[0]["question"])
        worst_dk, worst_dv = max(worst_dk, dk), max(worst_dv, dv)
    fidelity_report.append(
        f"{real_lm.name}: {questions} questions, {divergences} divergences (greedy, {GREEDY.max_new_tokens} new tokens), "
        f"max |dK| {worst_dk:.2e}, max |dV| {worst_dv:.2e}, exact match with pack {pack_correct}/{questions}"
    )
    assert questions >= MIN_QUESTIONS
    assert divergences == 0


def test_a_stored_prefix_is_the_kv_of_that_prefix(real_lm, tmp_path: Path) -> None:
    """A pack longer than a token block, read back as a prefix, holds the prefill of those tokens alone."""
    contexts = [row["context"] for row in eval_rows()[:16]]
    pack = build_pack(real_lm, contexts)
    assert pack.header.tokens > BLOCK_POSITIONS + 8
    prefix = BLOCK_POSITIONS + 7  # the first block and 7 positions of the second
    with LmdbStore(tmp_path / "store") as store:
        key, _ = store.put(encode_pack(pack))
        part = PackReader(store).fetch_part(key, prefix=prefix, model_fp=real_lm.model_fp, template_fp=real_lm.template_fp)
    alone = prefill(real_lm, pack.header.token_ids[:prefix])
    for layer, (k, v) in enumerate(zip(part.keys, part.values)):
        assert torch.equal(k, pack.keys[layer][:, :prefix]) and torch.equal(v, pack.values[layer][:, :prefix])
        expected_k, expected_v = alone.layers[layer].keys[0].to(k.dtype), alone.layers[layer].values[0].to(k.dtype)
        assert torch.allclose(k, expected_k, atol=1e-3) and torch.allclose(v, expected_v, atol=1e-3)


def test_wrong_template_on_a_real_model_is_refused(real_lm) -> None:
    facts = [eval_rows()[0]["context"]]
    pack = build_pack(real_lm, facts)
    altered = load_model(real_lm.name, progress=False, chat_template=real_lm.tokenizer.chat_template.replace("\n", "\n\n", 1))
    assert altered.model_fp == real_lm.model_fp
    with pytest.raises(PackMismatch, match="template mismatch"):
        answer_with_pack(altered, pack, "Who?", GREEDY)


def test_raw_pack_is_exact_against_raw_text_and_flagged(real_lm) -> None:
    row = eval_rows()[1]
    pack = build_pack(real_lm, [row["context"]], raw=True)
    assert pack.header.raw
    assert (
        answer_with_pack(real_lm, pack, row["question"], GREEDY).token_ids
        == answer_with_text(real_lm, [row["context"]], row["question"], raw=True, sampling=GREEDY).token_ids
    )


def test_pack_of_one_model_is_refused_by_the_other(real_model) -> None:
    smol, gemma = (real_model(name) for name in MODELS)
    pack = build_pack(smol, ["The Velmora Observatory stands on Mount Tarrin."])
    with pytest.raises(PackMismatch, match="model mismatch"):
        answer_with_pack(gemma, pack, "Where is the observatory?", GREEDY)


@pytest.mark.usefixtures("packctl_on_loaded_models")
def test_packctl_on_a_real_model(tmp_path: Path, capsys) -> None:
    """The console script end to end on smollm2-135m with the bundled example facts: build, ask and inspect run as
    processes of their own; the raw build and the refusal by the other model run the same commands through packctl's
    main in this process, on the run's loaded models (a process of their own would load torch and a model again)."""
    bin_dir = Path(sys.executable).parent
    store = tmp_path / "store"
    env = os.environ | {"PACKSTORE_STORE": str(store)}

    def packctl(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(bin_dir / "packctl"), *argv], capture_output=True, text=True, env=env)

    built = packctl("build", str(REPO / "examples" / "facts.txt"), "--model", "smollm2-135m", "--name", "velmora", "--json")
    assert built.returncode == 0, built.stderr
    asked = packctl(
        "ask", "velmora", "--questions", str(REPO / "examples" / "questions.jsonl"), "--model", "smollm2-135m", "--compare-rag"
    )
    assert asked.returncode == 0, asked.stderr
    answers = [json.loads(line) for line in asked.stdout.splitlines()]
    assert len(answers) == 5 and all(a["identical"] for a in answers)
    assert any("Brandqvist" in a["answer"] for a in answers)
    raw = packctl_main(["--store", str(store), "build", str(REPO / "examples" / "facts.txt"), "--model", "smollm2-135m", "--raw", "--name", "velmora-raw"])
    assert raw == 0, capsys.readouterr().err
    inspected = json.loads(packctl("inspect", "velmora-raw", "--json").stdout)
    assert inspected["raw"] is True
    capsys.readouterr()
    wrong = packctl_main(["--store", str(store), "ask", "velmora", "Who founded it?", "--model", "gemma3-270m"])
    assert wrong == 1 and "model mismatch" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_codec_is_bit_exact_on_real_kv(dtype: str) -> None:
    """KV from smollm2-135m computed in each dtype survives encode/decode bit for bit, and beats plain zstd."""
    import zstandard
    from safetensors.torch import save

    lm = load_model("smollm2-135m", dtype=dtype, progress=False)
    facts = [row["context"] for row in eval_rows()[:3]]
    pack = build_pack(lm, facts)
    encoded = encode_pack(pack)
    decoded = decode_pack(encoded)
    for a, b in zip(pack.keys + pack.values, decoded.keys + decoded.values):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    plain = sum(len(zstandard.compress(save({"k": k, "v": v}), 3)) for k, v in zip(pack.keys, pack.values))
    assert sum(len(c) for c in encoded.chunks) < plain
