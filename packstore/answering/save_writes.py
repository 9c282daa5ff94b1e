"""Saves from serving written to the store off the engine's forward passes (issue 64 item 3): a captured save becomes
its pack (``engine_pack``: this engine's arithmetic, its key's recipe), is encoded and put on a thread of its own, named
only where the name is free, and signed where the connector signs. Each ends reported once: stored, stored already, or
why it failed (the request's answer went out when its range was computed; a failed write is logged and counted)."""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from packstore.answering.save_capture import CapturedSave
from packstore.answering.saves import SavePlan
from packstore.errors import PackNotFound
from packstore.kv.engine_build import engine_pack
from packstore.packs.admin import sign_pack
from packstore.packs.tensors import encode_pack
from packstore.security.trust import SigningKey
from packstore.store.protocol import PackStore

log = logging.getLogger("packstore.saves")


@dataclass(frozen=True)
class SaveWritten:
    """How a save ended: ``stored`` (newly, or already there), and the name it got; else ``failure``."""

    plan: SavePlan
    stored: bool
    named: str | None = None
    failure: str | None = None


class SaveWriter:
    """``submit(plan, captured, identity)`` builds and stores the pack on one thread (saves are written in order);
    ``finished()`` hands back what ended. ``identity``: the served model and engine (``ServedModel.identity``);
    ``machine``: what the rows were computed on (the pack's ``built_on``)."""

    def __init__(self, stores: Callable[[str], PackStore], machine: Mapping[str, Any], signing: SigningKey | None = None) -> None:
        self._stores, self.machine, self.signing = stores, dict(machine), signing
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="packstore-save")
        self._ended: queue.SimpleQueue[SaveWritten] = queue.SimpleQueue()

    def submit(self, plan: SavePlan, captured: CapturedSave, identity: Mapping[str, Any]) -> None:
        self._pool.submit(self._run, plan, captured, dict(identity))

    def _run(self, plan: SavePlan, captured: CapturedSave, identity: dict[str, Any]) -> None:
        try:
            ended = self._write(plan, captured, identity)
        except Exception as exc:  # a store that refuses (a read-only token, a full store) fails this save alone
            ended = SaveWritten(plan, False, failure=f"{type(exc).__name__}: {exc}")
            log.warning("packstore: saving pack %s of request %s failed: %s", plan.key[-12:], plan.request_id, ended.failure)
        self._ended.put(ended)

    def _write(self, plan: SavePlan, captured: CapturedSave, identity: dict[str, Any]) -> SaveWritten:
        store = self._stores(plan.namespace)
        if _stored(store, plan.key):  # another request saved it meanwhile
            return SaveWritten(plan, True)
        pack = engine_pack(
            plan.token_ids, plan.facts, [k.cpu() for k in captured.keys], [v.cpu() for v in captured.values], captured.steps,
            model_fp=identity["model_fp"], template_fp=identity["template_fp"], model_name=identity.get("model_name", ""),
            dtype=identity["dtype"], machine=self.machine, engine=identity["engine"],
        )
        if pack.header.key != plan.key:
            raise ValueError(f"the captured pack's key {pack.header.key[-12:]} is not the planned {plan.key[-12:]}")
        name = plan.name if plan.name is not None and not _stored(store, plan.name, identity["model_fp"]) else None
        store.put(encode_pack(pack), name=name)
        if self.signing is not None:
            sign_pack(store, plan.key, self.signing)
        log.info("packstore: saved pack %s of request %s%s", plan.key[-12:], plan.request_id, f" as {name!r}" if name else "")
        return SaveWritten(plan, True, named=name)

    def finished(self) -> list[SaveWritten]:
        """The saves that ended since the last call."""
        ended = []
        while not self._ended.empty():
            ended.append(self._ended.get())
        return ended

    def close(self, wait: bool = False) -> None:
        self._pool.shutdown(wait=wait)


def _stored(store: PackStore, ref: str, model_fp: str | None = None) -> bool:
    """Whether ``store`` holds a pack ``ref`` names (a key; or a name, of ``model_fp``'s packs where given)."""
    try:
        store.resolve(ref, model_fp=model_fp)  # the index alone: no header is read
    except PackNotFound:
        return False
    return True
