"""Use a pack: check identities and tokens, inject its K/V as ``past_key_values``, generate."""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from queue import SimpleQueue
from typing import TypeVar

import torch
from transformers import DynamicCache, DynamicLayer, GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from packstore.errors import InvalidInput, PackMismatch
from packstore.format import PackHeader
from packstore.kv.build import cache_tensors, prefill
from packstore.kv.device import Cancel, DeviceLock, Left, Seat
from packstore.kv.models import LoadedModel, ModelSide
from packstore.kv.render import Rendering, Turn, check_prefix, render
from packstore.packs.tensors import FETCH_SECONDS, ArrivingPack, Pack

GREEDY_BELOW = 1e-5
MAX_TEMPERATURE = 100.0
MAX_NEW_TOKENS = 1 << 15
MAX_STOPS = 16  # stop strings one request may give (OpenAI allows 4)
MAX_STOP_CHARS = 256  # the longest stop string
QUEUED_TOKENS = 16  # tokens a streamed generation runs ahead of its reader before it waits (off the device) for room
LOOK_SECONDS = 0.05  # how often a wait for an arriving layer looks whether its reader has gone
R = TypeVar("R")


@dataclass(frozen=True)
class Sampling:
    """Decoding options; ``temperature`` 0 means greedy (the default, and what equivalence is checked on), and so does
    any temperature below GREEDY_BELOW (dividing logits by it would overflow them, as vLLM also treats it). ``stop``:
    strings that end the answer where one first appears in its decoded text; the answer is cut before it (as
    OpenAI's ``stop``)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise InvalidInput(f"max_new_tokens must be from 1 to {MAX_NEW_TOKENS}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE or not 0 < self.top_p <= 1:  # (NaN fails both)
            raise InvalidInput(f"temperature must be from 0 to {MAX_TEMPERATURE:g} and top_p in (0, 1]")
        if len(self.stop) > MAX_STOPS or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop):
            raise InvalidInput(f"stop takes at most {MAX_STOPS} strings, each of 1 to {MAX_STOP_CHARS} characters")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class Answer:
    """Generated text and ids, and how many prompt tokens the model had to prefill for it."""

    text: str
    token_ids: list[int]
    prompt_tokens: int


def check_identity(lm: ModelSide, header: PackHeader, kind: str = "knowledge") -> None:
    """Raise PackMismatch naming the kind, model or template when the pack is not a ``kind`` pack made for ``lm``."""
    if header.kind != kind:
        article = "an" if kind[0] in "aeiou" else "a"
        raise PackMismatch("kind", f"pack {header.key} is a {header.kind} pack, not {article} {kind} pack")
    try:
        header.check_identities(lm.model_fp, lm.template_fp)
    except PackMismatch as exc:
        raise PackMismatch(exc.what, f"{exc} (loaded: {lm.name!r}, {lm.dtype_name})") from None


def prepare(lm: ModelSide, header: PackHeader, question: str, history: Sequence[Turn] = ()) -> Rendering:
    """Render pack facts + earlier turns + question in one pass and check the pack is exactly its prefix."""
    check_identity(lm, header)
    rendering = render(lm.tokenizer, header.facts, question.strip(), raw=header.raw, history=history)
    check_prefix(header.token_ids, rendering, lm.tokenizer)
    return rendering


def cache_aligned_ids(header: PackHeader, token_ids: Sequence[int], placeholder: int = 0) -> list[int]:
    """``token_ids`` (a rendering that starts with the pack's tokens) with ``placeholder`` at each of the
    pack's soft-token positions, so that index i is cache position i; the placeholders are cached,
    never run. Unchanged for a pack without soft tokens."""
    ids = list(token_ids)
    if not header.soft_tokens:
        return ids
    aligned, previous = [], 0
    for index, count in header.soft_tokens:
        aligned += ids[previous:index] + [placeholder] * count
        previous = index
    return aligned + ids[previous:]


def _arriving_tensor(slot: str) -> property:
    """A PackLayer's K or V: reading takes the pack's layer first; whatever is set replaces it (a reset, say)."""

    def get(layer: PackLayer) -> torch.Tensor | None:
        layer._arrive()
        return getattr(layer, slot)

    def set(layer: PackLayer, value: torch.Tensor | None) -> None:
        layer._take = None
        setattr(layer, slot, value)

    return property(get, set)


class PackLayer(DynamicLayer):
    """A DynamicLayer that starts as one layer of a pack, taken only when the model first needs it: an
    ``ArrivingPack``'s layer may still be decoding while the model runs the layers before it. The first update
    concatenates the pack's K/V with the new states, the one copy made; the pack's tensors are never written."""

    def __init__(self, take: Callable[[], tuple[torch.Tensor, torch.Tensor]], positions: int) -> None:
        super().__init__()
        self._take: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = take
        self._positions = positions

    keys = _arriving_tensor("_keys")
    values = _arriving_tensor("_values")

    def _arrive(self) -> None:
        take: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = getattr(self, "_take", None)  # unset in __init__
        if take is not None:
            self._take = None
            self._keys, self._values = take()
            self.dtype, self.device, self.is_initialized = self._keys.dtype, self._keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        self._arrive()
        return super().update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self) -> int:
        return self._positions if self._take is not None else super().get_seq_length()


def cache_from_pack(
    pack: Pack | ArrivingPack,
    device: torch.device,
    tokens: int | None = None,
    *,
    cache: DynamicCache | None = None,
    wait_seconds: float = FETCH_SECONDS,
) -> DynamicCache:
    """A fresh DynamicCache (or the empty ``cache`` given, e.g. a steered one) holding the pack's K/V
    (its first ``tokens`` positions) on ``device``; generation or a further prefill extends it, leaving the
    pack as it is. Each layer is taken when the model reaches it, so an arriving pack's later layers decode
    while the model runs the first ones; a layer that fails to arrive raises there. A generation that reaches a
    layer not in yet waits for it with the device given up (``_off_device``), at most ``wait_seconds``
    (Unavailable naming the pack past it: the store has stalled)."""
    cache = DynamicCache() if cache is None else cache
    positions = pack.header.positions if tokens is None else min(tokens, pack.header.positions)

    def take(slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(pack, ArrivingPack) and not pack.arrived(slot):
            _off_device(partial(_await_layer, pack, slot, wait_seconds))
        k, v = pack.layer(slot)
        return k[:, :positions].unsqueeze(0).to(device), v[:, :positions].unsqueeze(0).to(device)

    cache.layers = [PackLayer(partial(take, slot), positions) for slot in range(len(pack.header.body_layers))]
    return cache


def greedy_with_logits(
    lm: LoadedModel, token_ids: Sequence[int], max_new_tokens: int, cache: DynamicCache | None = None
) -> tuple[list[int], torch.Tensor]:
    """Greedy answer ids after ``token_ids`` (stop tokens cut) and, per answer token, the logits it was
    chosen from ([answer tokens, vocabulary]; the first row even for an empty answer)."""
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=lm.device)
    with torch.inference_mode():
        out = lm.model.generate(  # type: ignore[operator]  # GenerationMixin's, undeclared on PreTrainedModel: typed Tensor | Module
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            **{lm.cache_argument: cache},
            generation_config=_generation_config(lm, Sampling(max_new_tokens=max_new_tokens)),
            return_dict_in_generate=True,
            output_logits=True,
        )
    answer = out.sequences[0, ids.shape[1] :].tolist()
    while answer and answer[-1] in lm.stop_token_ids:
        answer.pop()
    return answer, torch.cat(out.logits[: max(len(answer), 1)]).float()


def forced_logits(
    lm: LoadedModel, token_ids: Sequence[int], answer_ids: Sequence[int], cache: DynamicCache | None = None
) -> torch.Tensor:
    """Teacher-forced logits after ``token_ids``: row i is the distribution the model gives ``answer_ids[i]`` after the
    answer's first i tokens ([max(len(answer_ids), 1), vocabulary], float32 on CPU; row 0 is the first answer token's).
    A ``cache`` holding the first positions of ``token_ids`` (a pack, ``cache_aligned_ids`` for soft tokens) is
    extended, as generation would extend it; only the positions after it are run. Comparing two caches' rows on the
    same answer measures how far their distributions are apart along it, not only at its first token."""
    seen = cache.get_seq_length() if cache is not None else 0
    ids = torch.tensor([list(token_ids[seen:]) + list(answer_ids[:-1])], dtype=torch.long, device=lm.device)
    with torch.inference_mode():
        output = lm.model(input_ids=ids, use_cache=True, **({lm.cache_argument: cache} if cache is not None else {}))
    return output.logits[0, -max(len(answer_ids), 1) :].float().cpu()


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the first place any of the ``stop`` strings appears, and whether one did."""
    found = [index for string in stop if (index := text.find(string)) >= 0]
    return (text[: min(found)], True) if found else (text, False)


def _generation_config(lm: LoadedModel, sampling: Sampling) -> GenerationConfig:
    options = dict(
        max_new_tokens=sampling.max_new_tokens,
        eos_token_id=list(lm.stop_token_ids),
        pad_token_id=lm.stop_token_ids[0],
        do_sample=not sampling.greedy,
    )
    if not sampling.greedy:
        options.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
    return GenerationConfig(**options)


class _StopWhenSet(StoppingCriteria):
    """Ends generation at the next token once ``event`` is set (the reader went away)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class _StopAtText(StoppingCriteria):
    """Ends generation once the decoded answer (the ids after the first ``prompt`` ones) holds one of the ``stop``
    strings. Only the last tokens are decoded, enough for the longest string even at one byte per token."""

    def __init__(self, tokenizer, stop: Sequence[str], prompt: int) -> None:
        self.tokenizer, self.stop, self.prompt = tokenizer, tuple(stop), prompt
        self.window = 4 * max(map(len, stop)) + 4

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        tail = input_ids[0, max(self.prompt, input_ids.shape[1] - self.window) :].tolist()
        found = cut_at_stop(self.tokenizer.decode(tail, skip_special_tokens=True), self.stop)[1]
        return torch.full((input_ids.shape[0],), found, dtype=torch.bool, device=input_ids.device)


def _run_generate(
    lm: LoadedModel, ids: torch.Tensor, sampling: Sampling, cache: DynamicCache | None, streamer=None, stop: threading.Event | None = None
) -> torch.Tensor:
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    criteria: list[StoppingCriteria] = [_StopWhenSet(stop)] if stop is not None else []
    criteria += [_StopAtText(lm.tokenizer, sampling.stop, ids.shape[1])] if sampling.stop else []
    with torch.inference_mode():
        return lm.model.generate(  # type: ignore[operator]  # GenerationMixin's, undeclared on PreTrainedModel: typed Tensor | Module
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            **{lm.cache_argument: cache},
            generation_config=_generation_config(lm, sampling),
            streamer=streamer,
            stopping_criteria=StoppingCriteriaList(criteria) if criteria else None,
        )


def answer_of(lm: ModelSide, new: list[int], prompt_tokens: int, stop: Sequence[str] = ()) -> Answer:
    """The answer of the ``new`` ids: stop tokens dropped, the text cut before the first ``stop`` string."""
    while new and new[-1] in lm.stop_token_ids:
        new.pop()
    text = lm.tokenizer.decode(new, skip_special_tokens=True)
    assert isinstance(text, str)  # one list of ids decodes to one string (decode is typed for batches too)
    return Answer(text=cut_at_stop(text, stop)[0].strip(), token_ids=new, prompt_tokens=prompt_tokens)


def check_context(lm: LoadedModel, tokens: int) -> None:
    """InvalidInput when a prompt of ``tokens`` (the pack's included) is longer than the model's context: past it the
    positions are ones the model never saw, and attention over a prompt far past it can take gigabytes."""
    context = getattr(lm.model.config, "max_position_embeddings", None)
    if context and tokens > context:
        raise InvalidInput(f"the prompt has {tokens} tokens, more than the {context} of {lm.name}'s context: shorten the question")


def generate(
    lm: LoadedModel, token_ids: Sequence[int], sampling: Sampling, cache: DynamicCache | None = None, *, device: DeviceLock | None = None
) -> Answer:
    """Generate after ``token_ids``; with ``cache`` the model prefills only the ids the cache lacks. ``device``: the
    lock shared with other generations, taken for the prefill and then one step at a time (``_taking_turns``)."""
    check_context(lm, len(token_ids))
    cached = cache.get_seq_length() if cache is not None else 0
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=lm.device)
    if device is None:
        out = _run_generate(lm, ids, sampling, cache)
    else:
        seat = device.seat()
        seat.take()
        try:
            with _taking_turns(lm, seat, sampling):
                out = _run_generate(lm, ids, sampling, cache)
        finally:
            seat.release()
    return answer_of(lm, out[0, ids.shape[1] :].tolist(), ids.shape[1] - cached, sampling.stop)


@dataclass
class _Turns:
    """A generation taking turns at the device on this thread: ``seat`` holds it, ``saving`` keeps its random
    generator's state across the others' turns (a seeded sampled generation), ``stepped`` once its prefill ran."""

    seat: Seat
    saving: Callable[[], Callable[[], None]] | None
    stepped: bool = False


_turns = threading.local()  # .current: the _Turns of the generation running on this thread, if it takes turns
_hooked: weakref.WeakSet = weakref.WeakSet()  # the models ``_between_steps`` is registered on
_hooked_lock = threading.Lock()


def _between_steps(module: torch.nn.Module, args: tuple) -> None:
    """The model's forward pre-hook: a generation taking turns (``_turns.current``) that ran a step before this
    one passes the device to those waiting and waits for its turn again (``Seat.pass_on``) before it runs the next.
    So the device passes between a token's step and the next, never within one: the token of the step before has
    been chosen and streamed, and a generation that has ended runs no next step and passes nothing. Left while it
    waited (its reader went away): ``Left`` ends its ``generate`` before the step."""
    turns: _Turns | None = getattr(_turns, "current", None)
    if turns is not None:
        if turns.stepped:
            turns.seat.pass_on(turns.saving)
        turns.stepped = True


def _off_device(wait: Callable[[], R]) -> R:
    """Run ``wait`` (for the store or for the reader: never for the device) with the device given up when the
    generation on this thread holds it through a seat, then queue for it again behind those waiting, a seeded
    generation's random state kept across (as ``Seat.pass_on`` does): so no other generation waits at the device
    while this one waits on I/O. Left when its reader went meanwhile; a ``wait`` that fails leaves it holding nothing."""
    turns: _Turns | None = getattr(_turns, "current", None)
    if turns is None or not turns.seat.held:
        return wait()
    restore = turns.saving() if turns.saving is not None else None
    turns.seat.release()
    result = wait()
    if not turns.seat.take():
        raise Left
    if restore is not None:
        restore()
    return result


def _await_layer(pack: ArrivingPack, slot: int, seconds: float) -> None:
    """Wait for the ``slot``-th layer of ``pack`` at most ``seconds`` (Unavailable past it); Left as soon as the
    reader of the generation on this thread has gone (its seat left)."""
    turns: _Turns | None = getattr(_turns, "current", None)
    deadline = time.monotonic() + seconds
    while not pack.arrived(slot, min(LOOK_SECONDS, max(deadline - time.monotonic(), 0.0))):
        if turns is not None and turns.seat.left:
            raise Left
        if time.monotonic() >= deadline:
            raise pack.late(slot, seconds)


def _random_state(device: torch.device) -> Callable[[], Callable[[], None]]:
    """What saves the random generators a sampled step draws from (the CPU's, and ``device``'s) and gives back what
    restores them: so a seeded generation draws the same numbers whatever ran between its steps."""

    def save() -> Callable[[], None]:
        cpu = torch.get_rng_state()
        accelerator = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        mps = torch.mps.get_rng_state() if device.type == "mps" else None

        def restore() -> None:
            torch.set_rng_state(cpu)
            if accelerator is not None:
                torch.cuda.set_rng_state(accelerator, device)
            if mps is not None:
                torch.mps.set_rng_state(mps)

        return restore

    return save


@contextmanager
def _taking_turns(lm: LoadedModel, seat: Seat, sampling: Sampling) -> Iterator[None]:
    """While it runs, the ``generate`` on this thread (its prefill run with the device ``seat`` holds) takes one
    step at a time, passing the device between steps to the generations and holders waiting (``_between_steps``).
    Its own cache keeps its positions meanwhile, so its tokens are those it would choose alone (greedy; and
    sampled with a seed, whose generator state is kept across the others' turns)."""
    with _hooked_lock:
        if lm.model not in _hooked:
            lm.model.register_forward_pre_hook(_between_steps)
            _hooked.add(lm.model)
    previous = getattr(_turns, "current", None)
    keeping = _random_state(lm.device) if not sampling.greedy and sampling.seed is not None else None
    _turns.current = _Turns(seat, keeping)
    try:
        yield
    finally:
        _turns.current = previous


class _GenerationThreads:
    """Long-lived threads that streamed generations run on. A generation goes to an idle thread (the one that ran
    last) or, when every one is busy, to a new one, which then stays: so there are as many as generations ever ran
    at once, which on the worker its generation slots bound (each request runs one generation at a time), and a
    generation never waits for a thread (a ``compare_rag`` comparison, say, while other generations wait for the
    device it holds). A thread is idle again before its generation's future is done, so a caller that waits for
    one generation and starts the next finds that same thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[SimpleQueue] = []
        self.threads = 0  # started (none ends)
        self.busy = 0

    def submit(self, fn: Callable[[], None]) -> Future:
        future: Future = Future()
        with self._lock:
            self.busy += 1
            if self._idle:
                tasks = self._idle.pop()
            else:
                tasks = SimpleQueue()
                self.threads += 1
                name = f"packstore-generate-{self.threads}"
                threading.Thread(target=self._serve, args=(tasks,), name=name, daemon=True).start()
        tasks.put((fn, future))
        return future

    def _serve(self, tasks: SimpleQueue) -> None:
        while True:
            fn, future = tasks.get()
            result, error = None, None
            try:
                result = fn()
            except BaseException as exc:  # handed to the future's waiter
                error = exc
            with self._lock:
                self.busy -= 1
                self._idle.append(tasks)
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
            del fn, future, result, error


_generators_lock = threading.Lock()
_generators: tuple[int, _GenerationThreads] | None = None  # (the process id they were made in, the threads)


def _generation_threads() -> _GenerationThreads:
    """The process's generation threads, made on first use (importing this module starts nothing) and made anew in a
    forked child, which inherits the parent's threads' state but not the threads. Streamed generation runs on these
    long-lived threads, not on a fresh thread per request: a fresh thread gets a fresh malloc arena whose pages
    fault in on first touch, a cost per request that grows with the positions (docs/benchmarks.md)."""
    global _generators
    with _generators_lock:
        if _generators is None or _generators[0] != os.getpid():
            _generators = (os.getpid(), _GenerationThreads())
        return _generators[1]


class _TokenQueue(BaseStreamer):
    """Receives token ids from ``generate`` (the first put is the prompt) and hands them to a reader (``get``; None
    once the generation has ended), holding at most QUEUED_TOKENS: a generation whose reader stops reading waits for
    room with the device given up (``_off_device``), so it stops taking turns until its reader reads again or goes
    (``close``: from then on its tokens are dropped, and no put waits)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._tokens: deque[int | None] = deque()
        self._closed = False
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            if not self._add(token, wait=False):
                _off_device(partial(self._add, token, wait=True))

    def _add(self, token: int, *, wait: bool) -> bool:
        """Queue ``token`` (dropped once closed), waiting for room if ``wait``; False when it is full and not ``wait``."""
        with self._changed:
            while not self._closed and len(self._tokens) >= QUEUED_TOKENS:
                if not wait:
                    return False
                self._changed.wait()
            if not self._closed:
                self._tokens.append(token)
                self._changed.notify_all()
            return True

    def end(self) -> None:
        with self._changed:
            self._tokens.append(None)
            self._changed.notify_all()

    def get(self) -> int | None:
        with self._changed:
            while not self._tokens:
                self._changed.wait()
            token = self._tokens.popleft()
            self._changed.notify_all()
            return token

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()


def generate_stream(
    lm: LoadedModel,
    token_ids: Sequence[int],
    sampling: Sampling,
    cache: DynamicCache | None = None,
    *,
    device: DeviceLock | None = None,
    cancel: Cancel | None = None,
) -> Generator[int, None, Answer]:
    """Like ``generate``, yielding each new token id as soon as it exists, the stop token that ends the answer
    included (it is not part of the answer, but a caller timing the first token sees it come). It runs on one of the
    generation threads (``_generation_threads``); with ``device``, it holds that lock for its prefill and then one
    step at a time, in turn with the other generations running (``_taking_turns``).

    The generator's return value is the final Answer. Closing the generator early (a cancelled
    stream) stops generation at the next token (or, waiting for its turn at the device, for room in its token queue
    or for a layer of an arriving pack, at once) and waits for it, so the device is free of it on return. ``cancel``
    does the same from any thread (its client has gone while its reader waits for a token), and the stream then
    raises Left. It runs at most QUEUED_TOKENS ahead of its reader (``_TokenQueue``).
    """
    check_context(lm, len(token_ids))
    cached = cache.get_seq_length() if cache is not None else 0
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=lm.device)
    streamer = _TokenQueue()
    failure: list[BaseException] = []
    stop = threading.Event()
    seat = device.seat() if device is not None else None

    def leave() -> None:
        stop.set()
        if seat is not None:
            seat.leave()
        streamer.close()

    if cancel is not None:
        cancel.when_cancelled(leave)

    def run() -> None:
        try:
            if seat is None:
                _run_generate(lm, ids, sampling, cache, streamer, stop)
            elif seat.take():
                try:
                    with _taking_turns(lm, seat, sampling):
                        _run_generate(lm, ids, sampling, cache, streamer, stop)
                finally:
                    seat.release()
            else:  # its reader went away before its turn came
                streamer.end()
        except Left:  # its reader went away while it waited for its next turn
            streamer.end()
        except BaseException as exc:  # surfaced to the reader below
            failure.append(exc)
            streamer.end()

    done = _generation_threads().submit(run)
    new: list[int] = []
    try:
        while (token := streamer.get()) is not None:
            new.append(token)
            yield token
    finally:
        leave()
        done.result()
    if failure:
        raise failure[0]
    if cancel is not None:
        cancel.check()
    return answer_of(lm, new, ids.shape[1] - cached, sampling.stop)


class TextDeltas:
    """The text each streamed token adds to the answer, so the pieces concatenate to the decoded answer.

    A byte-level token can end inside a UTF-8 character; its text is held back (``""``) until the
    character is complete instead of sending a replacement character. With ``stop`` strings, text that may be the
    start of one is held back too, and nothing from the first stop string on is ever sent; ``rest`` gives what
    was held back once the answer is over.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False  # a stop string appeared: the text is final

    def add(self, token: int) -> str:
        self.ids.append(token)
        if self.stopped:
            return ""
        now = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if now.endswith("\ufffd"):
            return ""
        now, self.stopped = cut_at_stop(now, self.stop)
        if not self.stopped:
            now = now[: len(now) - _stop_start(now, self.stop)]
        delta = now[len(self.text) :]
        self.text += delta
        return delta

    def rest(self) -> str:
        """The text held back as the possible start of a stop string, once no more tokens come."""
        if self.stopped:
            return ""
        now = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        delta = now[len(self.text) :]
        self.text += delta
        return delta


def _stop_start(text: str, stop: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins one of the ``stop`` strings (0 for none)."""
    return max((n for string in stop for n in range(min(len(string), len(text)), 0, -1) if string.startswith(text[-n:])), default=0)


def answer_with_pack(lm: LoadedModel, pack: Pack, question: str, sampling: Sampling = Sampling()) -> Answer:
    """Answer with the pack injected: the model prefills only the question's tokens."""
    rendering = prepare(lm, pack.header, question)
    return generate(lm, cache_aligned_ids(pack.header, rendering.token_ids), sampling, cache_from_pack(pack, lm.device))


def answer_with_text(
    lm: LoadedModel,
    facts: Sequence[str],
    question: str,
    *,
    raw: bool = False,
    sampling: Sampling = Sampling(),
    cache: DynamicCache | None = None,
    history: Sequence[Turn] = (),
    device: DeviceLock | None = None,
    cancel: Cancel | None = None,
) -> Answer:
    """The RAG baseline: the same facts rendered into the prompt as text, before the ``history`` turns and the question
    (``cache``: an empty cache to generate with, e.g. one steering the tokens after the facts; ``device`` and
    ``cancel``: see ``generate_stream``, which generates it)."""
    rendering = render(lm.tokenizer, facts, question.strip(), raw=raw, history=history)
    return finish(generate_stream(lm, rendering.token_ids, sampling, cache, device=device, cancel=cancel))


def finish(stream: Generator[int, None, R]) -> R:
    """Run a token stream (``generate_stream``, ``Answerer.stream``) to its end and return its return value."""
    while True:
        try:
            next(stream)
        except StopIteration as finished:
            return finished.value


def answer_with_chunked_text(
    lm: LoadedModel,
    header: PackHeader,
    token_ids: Sequence[int],
    sampling: Sampling,
    cache: DynamicCache | None = None,
    *,
    device: DeviceLock | None = None,
    cancel: Cancel | None = None,
) -> Answer | None:
    """The reference a pack's answer must equal bit for bit: the pack's tokens prefilled as text in the passes its
    header records (``prefill_chunks``), then ``token_ids`` (the rendering the pack answered, which starts with
    them) generated exactly as with the pack, through ``generate_stream`` on a generation thread. Only the cache's
    origin differs. ``cache``: an empty cache to fill (a steered one); None where the header records no prefill
    (a pack written before it was recorded, a spliced composition). ``device``: the lock held for the prefill, and
    taken turns at for the generation (``generate_stream``). ``cancel``: once cancelled, Left after the prefill's
    pass in progress (or the generation's step)."""
    if header.prefill_chunks is None:
        return None
    checked = cancel.check if cancel is not None else None
    with device if device is not None else nullcontext():
        filled = prefill(lm, header.token_ids, cache=cache, boundaries=header.prefill_chunks, after_pass=checked)
    return finish(generate_stream(lm, token_ids, sampling, filled, device=device, cancel=cancel))


def prefill_divergence(lm: LoadedModel, pack: Pack, question: str) -> tuple[float, float]:
    """max |dK| and max |dV| between the pack (standalone prefill) and a joint prefill of pack + question."""
    rendering = prepare(lm, pack.header, question)
    keys, values = cache_tensors(prefill(lm, rendering.token_ids), pack.header.tokens)
    dk = max((a.float() - b.float()).abs().max().item() for a, b in zip(pack.keys, keys))
    dv = max((a.float() - b.float()).abs().max().item() for a, b in zip(pack.values, values))
    return dk, dv
