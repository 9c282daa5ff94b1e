"""The worker half of a save (issue 64 item 3): the K/V rows a paged-attention engine writes for the requests that save,
kept as it writes them. Engine-free: plain tensors.

``SaveCapture.write`` takes what the attention backend's cache update takes for a whole batch (one layer's key and value
rows and their cache slots, ``-1`` for padding); the rows whose slots hold a saving request's positions are copied into
its buffers at those positions, for the whole batch at once: the saves' slots are a sorted table searched with
``torch.searchsorted``, and rows of no save are copied to a spare row, so the forward waits on no copy to the host.
``end_step`` records how many positions each forward pass wrote (the pack's ``prefill_chunks``), and ``complete`` hands
back the saves whose every position of every layer is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from packstore.answering.paged import slot_mapping


@dataclass(frozen=True)
class CapturedSave:
    """A save's rows, ready to become its pack (``kv.engine_build.engine_pack``): per layer K and V ``[tokens, kv heads,
    head dim]``, and how many positions each forward pass wrote, in order."""

    request_id: str
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    steps: tuple[int, ...]


@dataclass
class _Save:
    """One request's capture: positions [0, ``tokens``) of ``layers`` layers in its blocks ``block_ids``; its buffers
    hold one spare row (index ``tokens``) that the rows of other requests are copied to."""

    layers: int
    tokens: int
    block_ids: list[int]
    keys: torch.Tensor | None = None  # [layers, tokens + 1, kv heads, head dim], made by the first write
    values: torch.Tensor | None = None
    written: torch.Tensor | None = None  # [layers, tokens + 1] booleans
    steps: list[int] = field(default_factory=list)

    def store(self, layer: int, target: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Rows ``key``, ``value`` of layer ``layer`` at positions ``target`` (``tokens``: the spare row)."""
        if self.keys is None or self.values is None or self.written is None:
            shape = (self.layers, self.tokens + 1, *key.shape[1:])
            self.keys, self.values = key.new_empty(shape), value.new_empty(shape)
            self.written = torch.zeros(self.layers, self.tokens + 1, dtype=torch.bool, device=key.device)
        self.keys[layer].index_copy_(0, target, key)
        self.values[layer].index_copy_(0, target, value)
        self.written[layer].index_fill_(0, target, True)

    def written_positions(self) -> int:
        """The positions written in every layer (0 before the first write)."""
        if self.written is None:
            return 0
        return int(self.written[:, : self.tokens].sum(dim=1).min())

    def captured(self, request_id: str) -> CapturedSave:
        """The rows of a save whose positions are all written."""
        assert self.keys is not None and self.values is not None  # written, so made
        keys, values = self.keys[:, : self.tokens], self.values[:, : self.tokens]
        return CapturedSave(request_id, list(keys.unbind(0)), list(values.unbind(0)), tuple(self.steps))


class SaveCapture:
    """The rows of each active save, for a model of ``layers`` attention layers and a cache of ``block_size``-token blocks:
    ``begin`` a save, ``extend`` its blocks as the engine allocates them, ``write`` per layer, ``end_step`` after each
    forward pass, ``complete`` to take the finished ones; ``drop`` one whose request ended unfinished."""

    def __init__(self, layers: int, block_size: int) -> None:
        self.layers, self.block_size = layers, block_size
        self._saves: dict[str, _Save] = {}
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._order: list[_Save] = []

    def __bool__(self) -> bool:
        return bool(self._saves)

    def begin(self, request_id: str, tokens: int, block_ids: Sequence[int]) -> None:
        """Capture positions [0, ``tokens``) of request ``request_id``, whose first blocks are ``block_ids``."""
        self._saves[request_id] = _Save(self.layers, tokens, list(block_ids))
        self._changed()

    def extend(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Blocks the engine allocated to a saving request since (chunked prefill allocates them step by step)."""
        save = self._saves.get(request_id)
        if save is not None and block_ids:
            save.block_ids.extend(block_ids)
            self._changed()

    def drop(self, request_id: str) -> bool:
        """Forget a save whose request ended, or was preempted, before its rows were all written; whether it was
        still being captured (False: it completed, or never began)."""
        if self._saves.pop(request_id, None) is None:
            return False
        self._changed()
        return True

    def _changed(self) -> None:
        self._tables.clear()
        self._order = list(self._saves.values())

    def _table(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every active save's known slots, sorted, with the index of its save in ``_order`` and its position; on
        ``device`` as ``dtype`` (the batch's slots'), made once per change."""
        if (device, dtype) not in self._tables:
            slots: list[int] = []
            owners: list[int] = []
            positions: list[int] = []
            for index, save in enumerate(self._order):
                known = min(save.tokens, len(save.block_ids) * self.block_size)
                slots += slot_mapping(save.block_ids, self.block_size, 0, known)
                owners += [index] * known
                positions += range(known)
            found = torch.tensor(slots, dtype=torch.int64)
            order = torch.argsort(found)
            by_slot = (found[order], torch.tensor(owners, dtype=torch.int64)[order], torch.tensor(positions, dtype=torch.int64)[order])
            self._tables[(device, dtype)] = (by_slot[0].to(device, dtype), by_slot[1].to(device), by_slot[2].to(device))
        return self._tables[(device, dtype)]

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        """Keep the rows of layer ``layer`` (``[tokens, kv heads, head dim]``, as many as ``slots`` or more: padding)
        whose cache slots belong to a save, at their positions."""
        if not self._saves:
            return
        table, owners, positions = self._table(slots.device, slots.dtype)
        if not table.numel():
            return
        at = torch.searchsorted(table, slots).clamp_(max=table.numel() - 1)
        hit = table[at] == slots  # padding (-1) and the slots of other requests are in no save
        rows = slots.numel()
        for index, save in enumerate(self._order):
            target = torch.where(hit & (owners[at] == index), positions[at], save.tokens)
            save.store(layer, target, key[:rows], value[:rows])

    def end_step(self) -> None:
        """After a forward pass: record the positions it wrote of each save (a pass that runs past a save's tokens
        counts up to them)."""
        for save in self._saves.values():
            written = save.written_positions()
            if written > sum(save.steps):
                save.steps.append(written - sum(save.steps))

    def complete(self) -> list[CapturedSave]:
        """The saves whose every position of every layer is written (as of the last ``end_step``), handed back once."""
        done = [(request_id, save) for request_id, save in self._saves.items() if save.steps and sum(save.steps) == save.tokens]
        for request_id, _ in done:
            del self._saves[request_id]
        if done:
            self._changed()
        return [save.captured(request_id) for request_id, save in done]
