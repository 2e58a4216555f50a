"""A rank actor's lifecycle (`lifecycle.py`): every move the table allows is taken, every other
one refused; a join that an abort overtook leaves the actor aborted, not a member."""
import itertools

import pytest

from ftrain.control.lifecycle import (ABORTED, CREATED, JOINING, MEMBER, MOVES, SPARE, WARM, WARMING, IllegalMove,
                                      Lifecycle)

PATHS = {  # how an actor reaches each state
    CREATED: [], SPARE: [SPARE], WARMING: [SPARE, WARMING], WARM: [SPARE, WARMING, WARM],
    JOINING: [SPARE, JOINING], MEMBER: [SPARE, JOINING, MEMBER], ABORTED: [SPARE, ABORTED]}


def at(state: str) -> Lifecycle:
    life = Lifecycle()
    for s in PATHS[state]:
        life.move(s, 7 if s == MEMBER else None)
    return life


@pytest.mark.parametrize("frm,to", list(itertools.product(MOVES, MOVES)))
def test_exactly_the_moves_of_the_table_are_allowed(frm, to):
    life = at(frm)
    if to in MOVES[frm]:
        life.move(to, 3)
        assert life.state == to and life.generation == (3 if to == MEMBER else None)
    else:
        with pytest.raises(IllegalMove, match=f"{frm} -> {to} is not a move"):
            life.move(to)
        assert life.state == frm


def test_a_spares_life_through_generations():
    life = Lifecycle()
    for to in (SPARE, WARMING, WARM, JOINING):
        life.move(to)
    assert life.joined(1) and repr(life) == "member(1)"
    life.move(ABORTED)                      # a peer failed: aborted, then the next generation
    life.move(JOINING)
    assert life.joined(2) and life.generation == 2
    life.move(JOINING)                      # a planned re-form (grow back)
    life.move(ABORTED)                      # an abort overtakes the join
    assert not life.joined(3) and life.state == ABORTED and life.generation is None


def test_a_spare_is_warmed_again_by_a_driver_that_took_the_run_over():
    """A reattaching driver warms the surviving spares for its own store (`ActorGroup._attach`):
    warm ones, one whose warm-up raised, and a member a DP shrink made a spare."""
    for state in (WARM, WARMING, ABORTED):
        life = at(state)
        life.move(WARMING)
        life.move(WARM)
        life.move(JOINING)
        assert life.joined(9) and life.generation == 9
