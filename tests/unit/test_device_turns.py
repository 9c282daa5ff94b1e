"""The device shared per token (issue 53): a FIFO lock that generations hold one decode step at a time, so a short
answer takes its steps between long ones'; each generation's tokens are those it chooses alone; a generation whose
reader goes away while it waits for its turn stops at once; generations run on long-lived threads.

The tests hold the device (``with device:``) while generations start, so they all wait for it and then share it from
the same start; they wait on states (who waits for the device), never on times."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from packstore.answering.answer import Answerer, Question
from packstore.kv import inject
from packstore.kv.build import build_pack
from packstore.kv.device import DeviceLock, Left
from packstore.kv.inject import Sampling, generate_stream, prepare
from packstore.packs.tensors import encode_pack
from packstore.store import LmdbStore
from tests.helpers import device as device_helpers
from tests.helpers.device import take_turns

FACTS = ["The river Tamsin flows through the town of Wexley.", "Wexley is famous for its bells."]
WAIT_SECONDS = 120.0  # how long a state is waited for before the test fails (never reached when it passes)
# three generations of different lengths, greedy and seeded sampled (two: each would draw from the other's generator
# were its state not kept across turns); on the tiny model all three run to their length
ASKED = [
    ("Where does the river Tamsin flow?", Sampling(max_new_tokens=60)),
    ("What is the capital?", Sampling(max_new_tokens=90, temperature=1.0, seed=2)),
    ("What is Wexley famous for?", Sampling(max_new_tokens=8, temperature=1.0, seed=7)),
]


def wait_for(condition: Callable[[], object], what: str) -> None:
    device_helpers.wait_for(condition, what, WAIT_SECONDS)


@pytest.fixture
def store(tmp_path: Path, tiny_lm):
    with LmdbStore(tmp_path / "store") as store:
        store.put(encode_pack(build_pack(tiny_lm, FACTS)), name="wexley")
        yield store


class Steps:
    """The model's forward passes in the order they ran, by the thread that ran them (a forward pre-hook registered
    after the device's own, so it runs once the step holds the device)."""

    def __init__(self, model) -> None:
        assert model in inject._hooked  # (the turns' hook first: a generation took turns on this model before)
        self.threads: list[str] = []
        self._handle = model.register_forward_pre_hook(lambda module, args: self.threads.append(threading.current_thread().name))

    def remove(self) -> None:
        self._handle.remove()


def test_the_device_goes_to_waiters_in_the_order_they_asked() -> None:
    device, order = DeviceLock(), []
    device.acquire()
    threads = []
    for name in "abc":
        thread = threading.Thread(target=lambda name=name: (device.acquire(), order.append(name), device.release()))
        thread.start()
        threads.append(thread)
        wait_for(lambda: device.waiting == len(threads), f"{name} waits")
    device.release()
    for thread in threads:
        thread.join(WAIT_SECONDS)
    assert order == ["a", "b", "c"] and not device.locked() and device.handoffs == 3


def test_a_seat_keeps_the_device_while_no_one_waits_and_passes_it_when_someone_does() -> None:
    device = DeviceLock()
    seat = device.seat()
    assert seat.take() and seat.held
    seat.pass_on()  # no one waits: kept, nothing saved
    assert seat.held and seat.passes == 0 and device.handoffs == 0
    got = threading.Event()
    other = threading.Thread(target=lambda: (device.acquire(), got.set(), device.release()))
    other.start()
    wait_for(lambda: device.waiting == 1, "the other waits")
    saved: list[str] = []

    def saving() -> Callable[[], None]:
        saved.append("saved")
        return lambda: saved.append("restored")

    seat.pass_on(saving)  # the other runs first, then the seat has the device again
    assert got.is_set() and seat.held and seat.passes == 1 and saved == ["saved", "restored"]
    seat.release()
    other.join(WAIT_SECONDS)
    assert not device.locked()


def test_a_seat_left_while_it_waits_stops_waiting_and_holds_nothing() -> None:
    device = DeviceLock()
    device.acquire()
    seat, outcome = device.seat(), []
    waiting = threading.Thread(target=lambda: outcome.append(seat.take()))
    waiting.start()
    wait_for(lambda: device.waiting == 1, "the seat waits")
    seat.leave()
    waiting.join(WAIT_SECONDS)
    assert outcome == [False] and device.waiting == 0 and device.locked()  # the holder still holds it
    device.release()
    assert not device.locked() and not seat.take()  # left: it never takes the device again

    holder = device.seat()
    assert holder.take()
    holder.leave()  # left while holding it (its reader went away during a step): its next pass ends it
    with pytest.raises(Left):
        holder.pass_on()
    assert not device.locked()


def test_generations_taking_turns_choose_the_tokens_they_choose_alone(tiny_lm, store) -> None:
    questions = [Question(text, refs=("wexley",), sampling=sampling) for text, sampling in ASKED]
    alone = [list(Answerer(tiny_lm, store).stream(question)) for question in questions]
    assert [len(ids) for ids in alone] == [60, 90, 8]  # (each runs to its length)
    device = DeviceLock()
    answerer = Answerer(tiny_lm, store, device_lock=device)
    answerer.pack("wexley")  # ready: the generations do nothing else with the device
    steps = Steps(tiny_lm.model)
    try:  # each generation waits for the device; then they share it from the same start
        results = take_turns(device, [lambda question=question: list(answerer.stream(question)) for question in questions], WAIT_SECONDS)
    finally:
        steps.remove()
    assert [results[index] for index in range(3)] == alone  # greedy and seeded sampled: the tokens they chose alone
    # one step each in turn (a prefill, then a token's step), in the order they asked, while all three ran: 8 rounds
    first = steps.threads[:3]
    assert len(set(first)) == 3 and steps.threads[:24] == first * 8
    # then the two long ones alone in turn, then the longest alone: each step of a generation is one of its tokens
    assert [steps.threads.count(name) for name in first] == [60, 90, 8]
    assert not device.locked() and device.waiting == 0


def test_a_generation_closed_while_it_waits_for_its_turn_stops_at_once(tiny_lm, store) -> None:
    pack = Answerer(tiny_lm, store).pack("wexley")[0]
    rendering = prepare(tiny_lm, pack.header, ASKED[0][0])
    device = DeviceLock()
    tokens = generate_stream(tiny_lm, rendering.token_ids, Sampling(max_new_tokens=5000), inject.cache_from_pack(pack, tiny_lm.device), device=device)
    next(tokens)
    device.acquire()  # the generation passes the device at its next step, and waits for it again
    try:
        assert device.waiting == 1
        tokens.close()  # its reader goes: it stops waiting, and ends, while the device is still held here
        assert device.waiting == 0 and inject._generation_threads().busy == 0
    finally:
        device.release()
    assert not device.locked()


def test_generations_run_on_long_lived_threads_as_many_as_run_at_once(monkeypatch) -> None:
    threads = inject._GenerationThreads()
    monkeypatch.setattr(inject, "_generators", (inject.os.getpid(), threads))
    ran_on: list[str] = []
    for _ in range(3):  # one after another: the same thread
        inject._generation_threads().submit(lambda: ran_on.append(threading.current_thread().name)).result(WAIT_SECONDS)
    assert len(set(ran_on)) == 1 and threads.threads == 1
    together, release = threading.Barrier(3), threading.Event()

    def hold() -> str:
        together.wait(WAIT_SECONDS)  # all three run at once: each on a thread of its own
        release.wait(WAIT_SECONDS)
        return threading.current_thread().name

    futures = [threads.submit(hold) for _ in range(3)]
    release.set()
    names = {future.result(WAIT_SECONDS) for future in futures}
    assert len(names) == 3 and ran_on[0] in names and threads.threads == 3 and threads.busy == 0
    threads.submit(lambda: None).result(WAIT_SECONDS)
    assert threads.threads == 3  # idle ones are used again; none is made for nothing
