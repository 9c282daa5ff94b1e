"""One entry for composing packs, shared by ``packctl compose`` (``api.compose_and_store``) and answering
(``Question``, ``Answerer``): the rules a composition's mode, adapter and parts keep, its key, and the kernel
each mode runs."""

from __future__ import annotations

from collections.abc import Sequence

from packstore.errors import InvalidInput
from packstore.format import PackHeader, pack_key
from packstore.kv.compose import COMPOSE_MODES, Composition, compose_exact, splice
from packstore.kv.models import LoadedModel, ModelSide
from packstore.kv.packet import packet_compose
from packstore.kv.render import pack_prefix_ids
from packstore.packs.tensors import Pack


def check_composition(mode: str, adapter: str | None, parts: int) -> None:
    """Refuse (InvalidInput) an unknown ``mode``, an adapter without the packet mode or that mode without one,
    and fewer than 2 ``parts`` (packs, or packs and a bank's facts) to compose."""
    if mode not in COMPOSE_MODES:
        raise InvalidInput(f"unknown composition mode {mode!r}: use one of {', '.join(COMPOSE_MODES)}")
    if (mode == "packet") != bool(adapter):
        raise InvalidInput("a packet composition needs an adapter, and an adapter needs the packet mode")
    if parts < 2:
        raise InvalidInput(f"a composition ({mode}) needs at least 2 packs (or packs and a bank), got {parts}")


def composition_key(lm: ModelSide, facts: Sequence[str], *, raw: bool, mode: str = "exact", parents: Sequence[str] = ()) -> str:
    """The key of the ``mode`` composition holding ``facts`` in order, made of the parts ``parents`` (an adapter
    last); an exact composition's key is its tokens' alone, whatever its parts."""
    return pack_key(lm.model_fp, lm.template_fp, pack_prefix_ids(lm.tokenizer, facts, raw=raw), mode, parents)


def compose(lm: LoadedModel, mode: str, parts: Sequence[Pack | PackHeader], adapter: Pack | None = None) -> Composition:
    """Check (``check_composition``) and run the ``mode`` composition of ``parts``, in order: ``exact`` prefills the
    later parts' facts after the first part's K/V, so only the first needs its tensors (the others may be headers);
    ``rope``/``naive`` splice the parts' K/V; ``packet`` splices it in ``adapter``'s soft tokens."""
    check_composition(mode, adapter.header.key if adapter is not None else None, len(parts))
    if mode == "exact":
        later = [part if isinstance(part, PackHeader) else part.header for part in parts[1:]]
        return compose_exact(lm, _with_tensors(parts[:1], mode)[0], later)
    if adapter is not None:
        return packet_compose(lm, _with_tensors(parts, mode), adapter)
    return splice(lm, _with_tensors(parts, mode), mode)


def _with_tensors(parts: Sequence[Pack | PackHeader], mode: str) -> list[Pack]:
    """``parts``, each of which the ``mode`` composition needs the tensors of: a header alone is the caller's mistake."""
    packs = [part for part in parts if isinstance(part, Pack)]
    if len(packs) < len(parts):
        raise TypeError(f"the {mode} composition needs the tensors of these parts, not only their headers")
    return packs
