"""The max-min share rule (packstore/security/shares.py) on its own: greedy principals, however many, converge to
equal shares, a newcomer is served at once while the reserve lasts and otherwise within one holding time, and a
refusal names only the caller's own use and when to retry."""

from __future__ import annotations

import random

import pytest

from packstore.errors import LimitExceeded
from packstore.security.shares import ShareRule, Shares

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def take_all(shares: Shares, principal: str) -> int:
    taken = 0
    while shares.try_take(principal):
        taken += 1
    return taken


@pytest.mark.parametrize("capacity", [1, 2, 3, 4, 8, 16, 64])
def test_no_two_principals_can_starve_a_third_and_none_passes_the_capacity(capacity: int) -> None:
    shares = Shares("slots", ShareRule.default(capacity))
    taken = {p: take_all(shares, p) for p in ("b", "c", "a")}
    if capacity >= 3:
        assert taken["a"] >= 1, (capacity, shares.rule, taken)
    assert shares.in_use == sum(taken.values()) <= capacity
    assert ShareRule.default(16) == ShareRule(16, 16, 4) and ShareRule.default(4) == ShareRule(4, 4, 2)


def churn(shares: Shares, greedy: list[str], clock: Clock, rounds: int, rng: random.Random) -> None:
    """Greedy principals ask again after every unit given back; a random holder gives one back each round."""
    for _ in range(rounds):
        clock.now += 0.01
        for principal in rng.sample(greedy, len(greedy)):
            take_all(shares, principal)
        holders = [p for p in greedy if shares.held(p)]
        shares.give_back(rng.choice(holders))
    for principal in greedy:
        take_all(shares, principal)


@pytest.mark.parametrize("principals", [2, 6, 20])
def test_greedy_principals_converge_to_max_min_shares(principals: int) -> None:
    """16 units: whatever order they came in, greedy principals end with equal holdings (capacity // k each, the
    reserve kept free for newcomers), not first come first served."""
    clock, rng = Clock(), random.Random(principals)
    shares = Shares("slots", ShareRule.default(16), clock=clock)
    greedy = [f"p{i}" for i in range(principals)]
    take_all(shares, greedy[0])  # the first takes all a lone principal may: 12 of 16
    assert shares.held(greedy[0]) == 12
    churn(shares, greedy, clock, 400, rng)
    held = sorted(shares.held(p) for p in greedy)
    if principals <= 12:  # the 12 units outside the reserve, split as evenly as they go; the reserve stays free
        assert sum(held) == 12 and held[-1] - held[0] <= 1, held
        assert shares.try_take("newcomer")  # so a newcomer is served at once
    else:
        assert held.count(1) == 16 and held.count(0) == principals - 16, held


@pytest.mark.parametrize("principals", [6, 20])
def test_a_newcomer_below_its_share_is_served_within_one_holding_time(principals: int) -> None:
    """Greedy principals hold all the rule lets them and ask again the moment a unit comes back, before A does. With 6,
    the reserve is left and A is served at once. With 20, every unit is held; units come back one at a time, oldest
    first (each is held at most a holding time, the pacing rules' bound), and A gets one before all 16 have turned
    over once."""
    clock, rng = Clock(), random.Random(principals)
    shares = Shares("slots", ShareRule.default(16), clock=clock)
    greedy = [f"p{i}" for i in range(principals)]
    churn(shares, greedy, clock, 100, rng)
    if principals <= 12:
        assert shares.try_take("a")
        return
    clock.now += 0.01
    ahead = sum(1 for p in greedy if not shares.held(p))  # asking since before A
    assert shares.in_use == 16 and not shares.try_take("a")
    held_since = [p for p in greedy for _ in range(shares.held(p))]  # the order they give back in
    served_after = None
    for returned, holder in enumerate(held_since, 1):
        clock.now += 0.1
        shares.give_back(holder)
        for principal in rng.sample(greedy, len(greedy)):
            take_all(shares, principal)
        if shares.try_take("a"):
            served_after = returned
            break
    assert served_after is not None, "A was not served within one turnover of the 16 units"
    assert served_after <= ahead + 1 and shares.held("a") == 1  # right after the principals holding none that asked before it


def test_an_asker_that_stops_asking_loses_its_turn_after_ask_seconds() -> None:
    clock = Clock()
    shares = Shares("slots", ShareRule(capacity=2, per_principal=2, reserve=0, ask_seconds=2.0), clock=clock)
    assert shares.try_take("b") and shares.try_take("b")
    assert not shares.try_take("a")  # A asks, and goes away
    shares.give_back("b")
    assert not shares.try_take("b")  # the unit is kept for A, below its share and asking
    clock.now += 2.5
    assert shares.try_take("b")  # A's ask lapsed: B may take it again


def test_a_refusal_names_only_the_callers_own_use_and_when_to_retry() -> None:
    shares = Shares("generation slots", ShareRule.default(4))
    assert take_all(shares, "token:bob") == 2 and take_all(shares, "token:carol") == 1
    refusal = shares.refused("token:carol", "Generate")
    assert isinstance(refusal, LimitExceeded) and refusal.fields == {"retry_after_seconds": "0.5"}
    message = str(refusal)
    assert message.startswith("Generate: token:carol holds 1 of the generation slots") and "retry in 0.5 s" in message
    assert "bob" not in message
    with pytest.raises(LimitExceeded, match="all 4 generation slots are in use"):
        with shares.slot("token:alice", "Generate"):
            with shares.slot("token:alice", "Generate"):
                pass
    assert shares.held("token:alice") == 0 and shares.in_use == 3
