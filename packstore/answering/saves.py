"""Saves from serving, decided in a paged-attention engine's scheduler without the engine (issue 64 items 3 and 4).

A request whose ``kv_transfer_params`` says ``"save": true`` names facts (``pack: {"facts": [...]}`` or a chain of
packs) whose rendering its prompt begins with; the engine computes their K/V in its own arithmetic, and the pack of
them is stored under this engine's key. ``Saves.decide`` says, once per request, what the worker is to capture (a
``SavePlan``) or why nothing is saved (a ``SaveRefusal``, never an exception: this runs in the engine's scheduler):
saving is off, a field has the wrong type, no facts are named, the prompt does not begin with their rendering and go
on after it, the pack is stored already (no failure: it is there), some of its tokens were not computed by this
request, the store's service does not let this connector's token write there (``WriteRoles``), or the namespace's
hourly byte quota would be passed.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from packstore.answering.paged import PackPlan, ServedModel
from packstore.answering.transfer_params import transfer_fields
from packstore.errors import PackstoreError
from packstore.format.header import pack_key
from packstore.kv.render import common_prefix_length
from packstore.store.protocol import ReportsCaller

HOUR_S = 3600.0  # the window of save_bytes_per_hour
ASK_AGAIN_S = 30.0  # how soon a namespace whose service did not say who the connector is there is asked again

SAVE_FIELD = "kv_transfer_params.save must be true or false (a JSON boolean)"
SAVING_OFF = "saving is off: this server's connector does not set allow_save: true in its kv_connector_extra_config"
NAME_FIELD = "kv_transfer_params.name must be a non-empty string: the name the saved pack gets, if no pack has it"
NO_FACTS = (
    'kv_transfer_params.save stores the pack of some facts: name them in kv_transfer_params.pack, as {"facts": [...]} '
    "or a chain of packs [A, B]"
)


@dataclass(frozen=True)
class SavePlan:
    """What the worker captures and stores for a save request: the K/V of positions [0, len(``token_ids``)) of request
    ``request_id``, as pack ``key`` of ``facts`` in ``namespace``, named ``name`` where no pack has that name."""

    request_id: str
    namespace: str
    key: str
    token_ids: tuple[int, ...]
    facts: tuple[str, ...]
    name: str | None = None


@dataclass(frozen=True)
class SaveRefusal:
    """Why a save request stores nothing; ``key`` is set where the pack is stored already (no failure: it is there)."""

    reason: str
    key: str | None = None


class SaveQuota:
    """The bytes each namespace saved within the last hour (a sliding window), held to ``bytes_per_hour`` (0: no limit)."""

    def __init__(self, bytes_per_hour: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.bytes_per_hour, self._clock = bytes_per_hour, clock
        self._saved: dict[str, deque[tuple[float, int]]] = {}

    def charge(self, namespace: str, size: int) -> str | None:
        """Count ``size`` bytes against ``namespace``'s last hour; or, counting nothing, why they would pass its limit."""
        if not self.bytes_per_hour:
            return None
        now = self._clock()
        saved = self._saved.setdefault(namespace, deque())
        while saved and saved[0][0] <= now - HOUR_S:
            saved.popleft()
        used = sum(amount for _, amount in saved)
        if used + size > self.bytes_per_hour:
            return (
                f"namespace {namespace!r} saved {used} bytes in the last hour, and this pack's {size} more would pass its "
                f"save_bytes_per_hour of {self.bytes_per_hour}: nothing is saved"
            )
        saved.append((now, size))
        return None


class WriteRoles:
    """Whether this connector may write in each namespace, asked of each store's service (``ReportsCaller``: the role
    of the connector's token there) on a thread, never on the scheduler's: a store that does not authenticate (a local
    directory, a bucket) is written as opened. Until a service has answered, saves go ahead (one its token may not
    make fails at the store, and is counted); one that did not answer is asked again after ``ASK_AGAIN_S``."""

    def __init__(self, store_of: Callable[[str], object], namespaces: Iterable[str], clock: Callable[[], float] = time.monotonic) -> None:
        self._store_of, self._clock = store_of, clock
        self._refusals: dict[str, str | None] = {}  # namespace -> why this connector may not write there, or None
        self._asked: dict[str, float] = {}
        for namespace in namespaces:
            self._ask(namespace)

    def _ask(self, namespace: str) -> None:
        self._asked[namespace] = self._clock()
        threading.Thread(target=self._check, args=(namespace,), name="packstore-write-role", daemon=True).start()

    def _check(self, namespace: str) -> None:
        try:
            store = self._store_of(namespace)
            if not isinstance(store, ReportsCaller):
                self._refusals[namespace] = None
                return
            caller = store.caller()
        except PackstoreError:
            return  # unknown: asked again later
        self._refusals[namespace] = None if caller.may_write else (
            f"this server's connector may not write in namespace {namespace!r}: its token {caller.token!r} is {caller.role} "
            "there, and a save needs a write token (token_file in kv_connector_extra_config): nothing is saved"
        )

    def refusal(self, namespace: str) -> str | None:
        """Why a save in ``namespace`` would be refused by its store, if its service said so; else None."""
        if namespace in self._refusals:
            return self._refusals[namespace]
        if self._clock() - self._asked.get(namespace, -math.inf) >= ASK_AGAIN_S:
            self._ask(namespace)
        return None


def rendering_problem(rendering: Sequence[int], prompt: Sequence[int]) -> str | None:
    """Why ``prompt`` does not begin with the facts' ``rendering`` and go on after it (a save prefills exactly the
    rendering's positions, then the question), or None."""
    agreed = common_prefix_length(rendering, prompt)
    if agreed < min(len(rendering), len(prompt)):
        return (
            f"the prompt does not begin with the facts' rendering: their {len(rendering)} tokens as the served template "
            f"renders them differ from the prompt's at position {agreed} (facts {rendering[agreed]}, prompt {prompt[agreed]}): "
            "render the prompt with packctl render"
        )
    if len(prompt) <= len(rendering):
        return (
            f"the prompt does not go on after the facts' rendering: its {len(prompt)} tokens end within their "
            f"{len(rendering)}, and a save needs the question after them"
        )
    return None


class Saves:
    """The scheduler's save decisions for ``served``: ``allow`` (allow_save) turns saving on, ``roles`` says where the
    connector may not write, ``bytes_per_hour`` (save_bytes_per_hour, 0: no limit) holds each namespace to a byte quota
    over the last hour of ``clock``."""

    def __init__(
        self,
        served: ServedModel,
        *,
        allow: bool,
        roles: WriteRoles | None = None,
        bytes_per_hour: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if allow and served.engine_version is None:
            raise ValueError("saving needs the serving engine's version, which the keys of packs it computes record")
        self.served, self.allow, self.roles = served, allow, roles
        self.quota = SaveQuota(bytes_per_hour, clock)

    def decide(
        self, request_id: str, plan: PackPlan, prompt: Sequence[int], params: object, num_computed_tokens: int
    ) -> SavePlan | SaveRefusal | None:
        """The save of a request planned as ``plan``, with ``kv_transfer_params`` ``params`` (any JSON), of which the
        engine's prefix cache held the first ``num_computed_tokens`` tokens; None where it asks no save. A save that goes
        ahead is charged to its namespace's quota (so: once per request) and leaves ``plan`` loading nothing: the
        request computes every token it saves."""
        fields, _ = transfer_fields(params)  # unreadable params ask nothing: the plan says why
        wants = fields.get("save", False)
        if wants is False:
            return None
        if wants is not True:
            return SaveRefusal(SAVE_FIELD)
        if not self.allow:
            return SaveRefusal(SAVING_OFF)
        name = fields.get("name")
        if name is not None and (not isinstance(name, str) or not name):
            return SaveRefusal(NAME_FIELD)
        if plan.facts is None or plan.rendering is None:
            named = isinstance(fields.get("pack"), list | dict) and plan.reason is not None
            return SaveRefusal(f"the facts to save could not be read: {plan.reason}" if named else NO_FACTS)
        problem = rendering_problem(plan.rendering, prompt)
        if problem is not None:
            return SaveRefusal(problem)
        served, tokens = self.served, len(plan.rendering)
        key = pack_key(served.model_fp, served.template_fp, plan.rendering, engine=served.engine)
        if key in plan.stored:
            return SaveRefusal(f"pack {key[-12:]} of these facts, as this engine computes them, is stored already: not saved again", key)
        if num_computed_tokens > 0:
            return SaveRefusal(
                f"vLLM's prefix cache held the first {min(num_computed_tokens, tokens)} of the {tokens} tokens to save (an "
                "earlier request computed them, or a pack loaded them), so this request did not compute them: nothing is "
                "saved; send the request with a cache_salt of its own, so that it computes them all"
            )
        problem = self.roles.refusal(plan.namespace) if self.roles is not None else None
        problem = problem or self.quota.charge(plan.namespace, tokens * served.token_bytes)
        if problem is not None:
            return SaveRefusal(problem)
        plan.tokens, plan.reason = 0, None
        return SavePlan(request_id, plan.namespace, key, plan.rendering, plan.facts, name)
