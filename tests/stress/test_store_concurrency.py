"""Threads and processes sharing one store while its LMDB map grows from a tiny size (issue 11 item 5,
issue 12 item 1): no request fails for a reason other than NOT_FOUND, every stored pack verifies
afterwards, and every acknowledged put that was not deleted is present.

The short versions run in ``make test-all``; ``make test-long`` runs the ``long`` ones (more rounds).
"""

from __future__ import annotations

import multiprocessing
import random
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

from packstore.errors import PackNotFound
from packstore.format import EncodedPack
from packstore.packs.reader import PackReader
from packstore.store import LmdbStore

TINY_MAP = 64 * 1024


def encoded_packs(count: int, first_tokens: int, dim: int = 32) -> list[EncodedPack]:
    """``count`` packs with distinct keys (token counts ``first_tokens``, ``first_tokens + 1``, ...)."""
    # Imported here: the processes spawned below import this module and need no torch.
    from packstore.packs.tensors import encode_pack
    from tests.helpers.packs import make_pack

    return [encode_pack(make_pack(layers=2, tokens=first_tokens + i, dim=dim)) for i in range(count)]


def stream(store: LmdbStore, key: str) -> None:
    """Read a pack the ways the service and the worker do: whole (checksums verified), decoded straight from
    the map (``fetch`` holds its read transaction while the chunk threads decode), and chunk by chunk."""
    PackReader(store).get(key)
    PackReader(store).fetch(key)
    header = store.stat(key).header
    for _ in store.read_chunks(header, range(len(header.chunks))):
        pass


def run_threads(targets: list) -> list[str]:
    """Run the targets in threads; the tracebacks of those that raised."""
    errors: list[str] = []

    def guarded(target) -> None:
        try:
            target()
        except Exception:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=guarded, args=(target,)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def assert_all_verify(store: LmdbStore) -> None:
    damaged = [result for result in PackReader(store).verify_all() if not result.ok]
    assert damaged == []


@pytest.mark.parametrize("packs_per_writer", [6, pytest.param(100, marks=pytest.mark.long)], ids=["short", "long"])
def test_writers_grow_the_map_while_sixteen_threads_stream(tmp_path: Path, packs_per_writer: int) -> None:
    writers = 3
    seeds = encoded_packs(4, first_tokens=40)
    batches = [encoded_packs(packs_per_writer, first_tokens=100 + w * packs_per_writer) for w in range(writers)]
    acknowledged: list[str] = []
    writers_done = threading.Event()

    with LmdbStore(tmp_path / "store", map_size=TINY_MAP) as store:
        acknowledged += [store.put(encoded)[0] for encoded in seeds]

        def write(batch: list[EncodedPack]) -> None:
            for encoded in batch:
                acknowledged.append(store.put(encoded)[0])

        def read(seed: int) -> None:
            chosen = random.Random(seed)
            rounds = 0
            while not writers_done.is_set() or rounds < 3:
                rounds += 1
                stream(store, chosen.choice(acknowledged))
                if rounds % 5 == 0:
                    assert len(store.list()) >= len(seeds)
                    store.keys()

        def writers_then_done() -> None:
            try:
                errors = run_threads([lambda b=batch: write(b) for batch in batches])
                assert errors == [], errors
            finally:
                writers_done.set()

        errors = run_threads([writers_then_done] + [lambda s=seed: read(s) for seed in range(16)])
        assert errors == [], "\n".join(errors)
        assert sorted(store.keys()) == sorted(acknowledged)
        assert_all_verify(store)
    assert (tmp_path / "store" / "data.mdb").stat().st_size > 16 * TINY_MAP  # the map grew, many times


@dataclass
class StressResult:
    """What one stress run saw: unexpected errors, and for each key one thread alone touched, whether
    its last acknowledged operation left it present."""

    errors: list[str]
    own_present: dict[str, bool]


def stress(
    path: Path, shared: list[EncodedPack], own: list[list[EncodedPack]], rounds: int, seed: int
) -> StressResult:
    """One thread per ``own`` list: random put / delete / stream of its own packs and of the
    ``shared`` ones (which every thread races on), on a store opened from a tiny map."""
    errors: list[str] = []
    own_present: dict[str, bool] = {}

    def work(mine: list[EncodedPack], chosen: random.Random) -> None:
        present = {encoded.header.key: False for encoded in mine}  # after the last acknowledged put or delete
        for _ in range(rounds):
            encoded = chosen.choice(mine + shared)
            key = encoded.header.key
            op = chosen.choice(("put", "delete", "stream", "stream"))
            try:
                if op == "put":
                    store.put(encoded, name=f"n{key[-12:]}" if key in present else None)
                elif op == "delete":
                    store.delete(key)
                else:
                    stream(store, key)
                    if key in present:
                        assert store.stat(f"n{key[-12:]}").key == key
            except PackNotFound:
                if op == "put" or present.get(key):
                    raise AssertionError(f"{op} of {key} answered not found, yet it was stored") from None
                continue
            if key in present and op == "stream":
                assert present[key], f"{key} was streamed after its delete was acknowledged"
            elif key in present:
                present[key] = op == "put"
        own_present.update(present)

    with LmdbStore(path, map_size=TINY_MAP) as store:
        errors.extend(run_threads([lambda m=mine, s=seed * 100 + i: work(m, random.Random(s)) for i, mine in enumerate(own)]))
    return StressResult(errors=errors, own_present=own_present)


def check_after_stress(path: Path, results: list[StressResult], shared: list[EncodedPack]) -> None:
    assert [error for result in results for error in result.errors] == []
    with LmdbStore(path, readonly=True) as store:
        assert_all_verify(store)
        stored = set(store.keys())
        for result in results:
            for key, present in result.own_present.items():
                assert (key in stored) == present, key
        assert stored <= {key for result in results for key in result.own_present} | {e.header.key for e in shared}
    assert (path / "data.mdb").stat().st_size > 4 * TINY_MAP  # the map grew


def stress_packs(threads: int, own_each: int, first_tokens: int) -> tuple[list[EncodedPack], list[list[EncodedPack]]]:
    packs = encoded_packs(4 + threads * own_each, first_tokens=first_tokens, dim=16)
    return packs[:4], [packs[4 + t * own_each : 4 + (t + 1) * own_each] for t in range(threads)]


@pytest.mark.parametrize("rounds", [40, pytest.param(1000, marks=pytest.mark.long)], ids=["short", "long"])
def test_sixteen_threads_put_delete_and_stream_across_map_growth(tmp_path: Path, rounds: int) -> None:
    shared, own = stress_packs(threads=16, own_each=3, first_tokens=30)
    result = stress(tmp_path / "store", shared, own, rounds, seed=1)
    check_after_stress(tmp_path / "store", [result], shared)


def stress_in_process(args: tuple) -> StressResult:
    """``stress`` for ``Pool.map``: a module-level function, which a spawned process can import."""
    return stress(*args)


@pytest.mark.parametrize("rounds", [25, pytest.param(1000, marks=pytest.mark.long)], ids=["short", "long"])
def test_four_processes_put_delete_and_stream_across_map_growth(tmp_path: Path, rounds: int) -> None:
    processes, threads = 4, 4
    shared, own = stress_packs(threads=processes * threads, own_each=3, first_tokens=30)
    jobs = [(tmp_path / "store", shared, own[p * threads : (p + 1) * threads], rounds, p) for p in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        results = pool.map(stress_in_process, jobs)
    check_after_stress(tmp_path / "store", results, shared)
