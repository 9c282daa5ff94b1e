"""The vLLM connector's request rules, engine-free: whose arithmetic may enter vLLM's prefix cache (the salt rule and
the preference among packs that match), planning that never raises whatever a client sends, the requests vLLM cannot
take a pack into (LoRA, prompt_logprobs), unsigned packs left out of the automatic index alone, and counters of what
was really loaded (docs/protocol.md, "vLLM connector")."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging

import pytest
from hypothesis import strategies as st

from packstore.answering.arithmetic import (
    APPROXIMATE,
    ENGINE,
    MAX_CACHE_SALT,
    OTHER,
    EngineArithmetic,
    arithmetic_of,
    cache_salt_for,
    carries,
    pack_salt,
)
from packstore.answering.paged import MatcherCounters, PackMatcher, PackPlan, PrefixIndex, ServedModel
from packstore.answering.transfer_params import engine_refusal, transfer_fields
from packstore.kv.build import build_pack
from packstore.kv.compose import compose_exact, splice
from packstore.kv.render import render
from packstore.packs.tensors import Pack, encode_pack
from packstore.security.trust import SigningKey, TrustedKeys, generate_key
from packstore.store.lmdb.store import LmdbStore
from tests.helpers.fuzz import fuzz, texts
from tests.helpers.paged import served_tiny

PART_A, PART_B = ["The river Tamsin flows through the town of Wexley."], ["Wexley is famous for its bells."]
BLOCK = 4
VERSION = "0.32.0"
QUESTION = "Where are the bells?"


def engine_built(pack: Pack, version: str = VERSION, block_size: int = BLOCK) -> Pack:
    """``pack`` as if vLLM ``version`` had prefilled it with ``block_size`` (the header an engine build writes)."""
    engine = {"name": "vllm", "version": version, "block_size": block_size}
    header = dataclasses.replace(pack.header, engine=engine, built_on={"device": "cpu", "dtype": "float32"})
    return dataclasses.replace(pack, header=header)


@pytest.fixture(scope="module")
def built(tiny_lm):
    """Packs of the same tokens (A then B) in each arithmetic: vLLM's own, vLLM's of another version, transformers' and a
    RoPE splice; and the tiny model as an engine serves it. (A sequential composition of A and B is transformers' build
    of both, key and all.)"""
    a, b = build_pack(tiny_lm, PART_A), build_pack(tiny_lm, PART_B)
    whole = build_pack(tiny_lm, PART_A + PART_B)
    assert compose_exact(tiny_lm, a, [b.header]).pack.header.key == whole.header.key
    packs = {
        "engine": engine_built(whole),
        "old-engine": engine_built(whole, version="0.31.0"),
        "transformers": whole,
        "rope": splice(tiny_lm, [a, b], "rope").pack,
    }
    assert len({p.header.token_ids for p in packs.values()}) == 1 and len({p.header.key for p in packs.values()}) == 4
    return packs, served_tiny(tiny_lm, BLOCK, VERSION)


def store_of(tmp_path, packs: dict[str, Pack], names) -> LmdbStore:
    with LmdbStore(tmp_path / "store") as store:
        for name in names:
            store.put(encode_pack(packs[name]), name=name)
    return LmdbStore(tmp_path / "store", readonly=True)


def matcher_for(store: LmdbStore, served: ServedModel, **options) -> PackMatcher:
    matcher = PackMatcher(lambda namespace: store, served, **options)
    matcher.refresh()
    return matcher


def ask(tiny_lm) -> list[int]:
    return render(tiny_lm.tokenizer, PART_A + PART_B, QUESTION).token_ids


def test_the_salt_is_ps1_and_40_hex_after_the_clients_own_and_passes_vllms_checks() -> None:
    key = "m" * 64 + "/" + "t" * 64 + "/" + "r" * 64  # pack keys are about 194 characters with slashes
    salt = pack_salt(key)
    assert salt.startswith("ps1-") and len(salt) == 44 and all(c in "0123456789abcdef" for c in salt[4:])
    assert cache_salt_for(key) == salt and cache_salt_for(key, "tenant-7:") == "tenant-7:" + salt
    assert carries("tenant-7:" + salt, key) and carries(salt, key)
    assert not carries(salt + "x", key) and not carries(None, key) and not carries(["x"], key) and not carries(pack_salt(key + "x"), key)
    assert len(cache_salt_for(key, "o" * (MAX_CACHE_SALT - 44))) == MAX_CACHE_SALT
    with pytest.raises(ValueError, match="over vLLM's 128"):
        cache_salt_for(key, "o" * (MAX_CACHE_SALT - 43))
    for bad in ("a@b", "a/b", "a\\b", "a\x00"):
        with pytest.raises(ValueError, match="may not hold"):
            cache_salt_for(key, bad)


def test_each_pack_is_of_one_arithmetic(built) -> None:
    packs, served = built
    found = {name: arithmetic_of(pack.header, served.arithmetic) for name, pack in packs.items()}
    assert found == {"engine": ENGINE, "old-engine": OTHER, "transformers": OTHER, "rope": APPROXIMATE}
    other_blocks = dataclasses.replace(served, block_size=16).arithmetic
    assert arithmetic_of(packs["engine"].header, other_blocks) == OTHER
    assert arithmetic_of(packs["engine"].header, dataclasses.replace(served, dtype="bfloat16").arithmetic) == OTHER
    assert arithmetic_of(packs["engine"].header, EngineArithmetic("vllm", None, BLOCK, "float32")) == OTHER  # version unknown


def test_the_index_prefers_longer_then_own_then_exact_whatever_the_order_packs_were_filed() -> None:
    entries = [("k-rope", (1, 2, 3, 4, 5), APPROXIMATE), ("k-other", (1, 2, 3, 4, 5), OTHER), ("k-own", (1, 2, 3, 4, 5), ENGINE),
               ("k-other2", (1, 2, 3, 4, 5), OTHER), ("k-short", (1, 2, 3), ENGINE)]
    orders = set()
    for order in itertools.permutations(entries):
        index = PrefixIndex(block_size=2)
        for key, ids, arithmetic in order:
            index.add(key, ids, arithmetic)
        orders.add(tuple(key for key, _, _ in index.matches([1, 2, 3, 4, 5, 6])))
    assert orders == {("k-own", "k-other", "k-other2", "k-rope", "k-short")}


def test_this_engines_pack_wins_a_tie_then_another_exact_and_approximate_only_salted(tiny_lm, built, tmp_path) -> None:
    packs, served = built
    store = store_of(tmp_path, packs, packs)
    try:
        matcher = matcher_for(store, served)
        plan = matcher.plan(ask(tiny_lm), None)
        assert plan.applies and plan.key == packs["engine"].header.key and plan.report()["pack_arithmetic"] == "engine"
        rope_key = packs["rope"].header.key
        salted = matcher.plan(ask(tiny_lm), {}, cache_salt=cache_salt_for(rope_key))
        assert salted.key == packs["engine"].header.key  # exact preferred to approximate even where the salt allows both
    finally:
        store.close()


def test_an_approximate_pack_loads_only_in_a_request_salted_for_it(tiny_lm, built, tmp_path) -> None:
    packs, served = built
    store = store_of(tmp_path, packs, ["rope"])
    key = packs["rope"].header.key
    try:
        matcher = matcher_for(store, served)
        for params in (None, {"pack": "rope"}):
            for salt in (None, "tenant-7", pack_salt(key) + "x", pack_salt(packs["engine"].header.key)):
                plan = matcher.plan(ask(tiny_lm), params, cache_salt=salt)
                assert not plan.applies and plan.key == key and plan.arithmetic == APPROXIMATE
                assert f"cache_salt ends with {pack_salt(key)}" in plan.reason and "approximate" in plan.reason
            plan = matcher.plan(ask(tiny_lm), params, cache_salt=cache_salt_for(key, "tenant-7"))
            assert plan.applies and plan.report()["pack_arithmetic"] == "approximate"
        assert matcher.plan(ask(tiny_lm), {"pack": False}, cache_salt=cache_salt_for(key)).mode == "none"
    finally:
        store.close()


def test_a_naive_splice_is_refused_even_salted(tiny_lm, built, tmp_path) -> None:
    """Its later parts' keys sit at positions other than their tokens': no salt makes that K/V the prompt's."""
    _, served = built
    naive = splice(tiny_lm, [build_pack(tiny_lm, PART_A), build_pack(tiny_lm, PART_B)], "naive").pack
    store = store_of(tmp_path, {"naive": naive}, ["naive"])
    try:
        plan = matcher_for(store, served).plan(ask(tiny_lm), {"pack": "naive"}, cache_salt=cache_salt_for(naive.header.key))
        assert not plan.applies and "naive composition" in plan.reason and plan.arithmetic == APPROXIMATE
    finally:
        store.close()


@pytest.mark.parametrize("policy", ["unsalted", "salted"])
def test_exact_packs_of_other_arithmetic_follow_the_connector_setting(tiny_lm, built, tmp_path, policy) -> None:
    packs, served = built
    store = store_of(tmp_path, packs, ["engine", "transformers", "old-engine"])
    try:
        matcher = matcher_for(store, served, other_exact=policy)
        assert matcher.plan(ask(tiny_lm), {"pack": "engine"}).applies  # this engine's own: never salted
        for name in ("transformers", "old-engine"):
            key = packs[name].header.key
            plan = matcher.plan(ask(tiny_lm), {"pack": name})
            assert plan.applies is (policy == "unsalted") and plan.report()["pack_arithmetic"] == "other"
            if policy == "salted":
                assert 'other_exact: "salted"' in plan.reason and pack_salt(key) in plan.reason
                assert matcher.plan(ask(tiny_lm), {"pack": name}, cache_salt=cache_salt_for(key)).applies
    finally:
        store.close()


def test_automatic_mode_falls_back_to_a_pack_the_salt_allows(tiny_lm, built, tmp_path) -> None:
    packs, served = built
    store = store_of(tmp_path, packs, ["transformers", "rope"])
    try:
        matcher = matcher_for(store, served, other_exact="salted")
        plan = matcher.plan(ask(tiny_lm), None, cache_salt=cache_salt_for(packs["rope"].header.key))
        assert plan.applies and plan.key == packs["rope"].header.key  # the exact one needs a salt this request lacks
        unsalted = matcher.plan(ask(tiny_lm), None)
        assert not unsalted.applies and unsalted.key == packs["transformers"].header.key and "cache_salt" in unsalted.reason
    finally:
        store.close()


# ---- never raise ---------------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
transfer_params = st.one_of(
    json_values,
    st.dictionaries(st.sampled_from(["pack", "namespace", "save"]) | texts, json_values | st.sampled_from(["wexley", False, True]), max_size=4),
    st.dictionaries(st.integers() | st.none(), json_values, min_size=1, max_size=2),  # not JSON, but a Python client can send it
)


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ("wexley", "must be a JSON object, not a string"),
        ([["pack", "wexley"]], "must be a JSON object, not a list"),  # dict() would have read this as {"pack": "wexley"}
        (7, "must be a JSON object, not a number"),
        ({1: "x"}, "string field names"),
    ],
)
def test_kv_transfer_params_that_are_not_an_object_get_a_reason(tiny_lm, built, tmp_path, params, reason) -> None:
    packs, served = built
    store = store_of(tmp_path, packs, ["engine"])
    try:
        plan = matcher_for(store, served).plan(ask(tiny_lm), params)
        assert not plan.applies and reason in plan.reason and plan.report()["reason"] == plan.reason
    finally:
        store.close()
    assert transfer_fields(None) == ({}, None) and transfer_fields({"pack": "x"}) == ({"pack": "x"}, None)


def test_planning_is_total_over_any_params_salt_and_prompt(tiny_lm, built, tmp_path) -> None:
    packs, served = built
    store = store_of(tmp_path, packs, ["engine", "rope"])
    try:
        matcher = matcher_for(store, served)
        prompts = st.sampled_from([ask(tiny_lm), [], [0], list(range(50))]) | st.lists(st.integers(0, 200), max_size=60)

        def check(case) -> None:
            prompt, params, salt = case
            plan = matcher.plan(prompt, params, cache_salt=salt)
            assert isinstance(plan, PackPlan)
            json.dumps(plan.report())  # what comes back with the answer is JSON
            matcher.counters.count(plan)

        fuzz(300, st.tuples(prompts, transfer_params, st.none() | texts | json_values), check)
    finally:
        store.close()


# ---- requests vLLM cannot take a pack into ---------------------------------------------------------------------------


def test_lora_and_prompt_logprobs_requests_are_refused_only_where_a_pack_would_apply(tiny_lm, built, tmp_path) -> None:
    packs, served = built
    store = store_of(tmp_path, packs, ["engine"])
    lora = engine_refusal(lora="sql-adapter", skips_prefix_cache=False)
    logprobs = engine_refusal(lora=None, skips_prefix_cache=True)
    assert engine_refusal(lora=None, skips_prefix_cache=False) is None
    assert "LoRA adapter 'sql-adapter'" in lora and "base model's K/V" in lora and "prompt_logprobs" in logprobs
    try:
        matcher = matcher_for(store, served)
        for refusal in (lora, logprobs):
            for params in (None, {"pack": "engine"}):
                plan = matcher.plan(ask(tiny_lm), params, refusal=refusal)
                assert not plan.applies and plan.reason == refusal and plan.report()["pack_applied"] is False
            assert matcher.plan(ask(tiny_lm), {"pack": False}, refusal=refusal).reason is None
            assert matcher.plan(render(tiny_lm.tokenizer, ["Nobody packed this."], QUESTION).token_ids, None, refusal=refusal).reason is None
    finally:
        store.close()


# ---- counters and trust ----------------------------------------------------------------------------------------------


def test_counters_count_what_finished_loaded_not_what_was_planned() -> None:
    counters = MatcherCounters()
    loaded = PackPlan(key="k", pack_tokens=40, tokens=32, mode="explicit", loaded=24)
    failed = PackPlan(key="k", pack_tokens=40, tokens=32, mode="explicit", loaded=32, failure="loading the pack failed")
    for plan in (loaded, failed, PackPlan()):
        counters.count(plan)
    taken = counters.take()
    assert (taken["packs_applied"], taken["pack_tokens_loaded"], taken["packs_not_applied"]) == (1, 24, 1)


def test_an_unsigned_pack_alone_is_left_out_of_the_automatic_index(tiny_lm, built, tmp_path, caplog) -> None:
    packs, served = built
    private, public, _ = generate_key(tmp_path / "key")
    other = build_pack(tiny_lm, ["Bob lives in Oslo."])
    with LmdbStore(tmp_path / "store") as store:
        store.put(encode_pack(packs["engine"]), name="signed")
        store.add_signature("signed", SigningKey.load(private).sign("pack", store.stat("signed").header.pack_sha256))
        store.put(encode_pack(other), name="unsigned")
    with LmdbStore(tmp_path / "store", readonly=True) as store, caplog.at_level(logging.WARNING, logger="packstore.paged"):
        matcher = matcher_for(store, served, trusted=TrustedKeys.load(public))
        matcher.refresh()
        assert matcher.plan(ask(tiny_lm), None).applies  # the signed pack's namespace is indexed
        unsigned = matcher.plan(render(tiny_lm.tokenizer, ["Bob lives in Oslo."], "Who?").token_ids, None)
        assert unsigned.mode == "none" and unsigned.reason is None
        assert matcher.counters.take()["packs_untrusted_skipped"] == 1
        skipped = [r for r in caplog.records if "left out of the automatic index" in r.getMessage()]
        assert len(skipped) == 1 and other.header.key[-12:] in skipped[0].getMessage()
