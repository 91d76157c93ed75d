"""What the runner counts per generation besides its tokens: the reasoning tokens the server reported (never
more than the completion) and whether it ended at the dataset's max_new_tokens — a reply of a
conversation included — rather than at a reservation of the budget or a stop."""

from __future__ import annotations

from typing import Any

import pytest

from budget.spec import DatasetSpec
from tests.support.attempts import attempt_of
from workers.conversation import ConversationGeneration
from workers.runner import Attempt, SampleRunner
from workers.sglang.client import Generation

MAX_NEW = 48
LENGTH = {"type": "length", "length": MAX_NEW}
STOP = {"type": "stop", "matched": 2}


def attempt(max_new: int | None = MAX_NEW, cap: int = 0) -> Attempt:
    sampling = {} if max_new is None else {"max_new_tokens": max_new}
    spec = DatasetSpec(servers=("http://s",), output_dir="", sampling=sampling)
    return attempt_of(spec, cap)


def gen(tokens: int, finish: dict[str, Any] | None, meta: dict[str, Any] | None = None) -> Generation:
    return Generation("r", "http://s", [5] * tokens, "", finish, 3, tokens, meta_info=meta or {})


@pytest.mark.parametrize(
    ("generation", "a", "truncated", "hit"),
    [
        (gen(MAX_NEW, LENGTH), attempt(), False, True),
        (gen(30, STOP), attempt(), False, False),
        # a length finish short of max_new_tokens: the server clamped it (context left), not a hit
        (gen(40, {"type": "length", "length": 40}), attempt(), False, False),
        # cut at the budget: its reservation (or a stop) ended it, so it is truncated instead
        (gen(20, {"type": "length", "length": 20}), attempt(cap=20), True, False),
        (gen(MAX_NEW, LENGTH), attempt(), True, False),
        # a reservation of the whole max_new_tokens that the generation used up is a hit
        (gen(MAX_NEW, LENGTH), attempt(cap=MAX_NEW), False, True),
        (gen(MAX_NEW, LENGTH), attempt(max_new=None), False, False),
    ],
)
def test_a_generation_hit_max_new_only_when_it_ended_by_length_at_max_new_tokens(
    generation: Generation, a: Attempt, truncated: bool, hit: bool
) -> None:
    assert SampleRunner._hit_max_new(a, generation, truncated) is hit


def conversation(*replies: tuple[int, dict[str, Any]]) -> ConversationGeneration:
    turns = [{"completion_tokens": n, "finish_reason": finish} for n, finish in replies]
    last_tokens, last_finish = replies[-1]
    return ConversationGeneration(
        "r", "http://s", [5] * last_tokens, "", last_finish, 3, sum(n for n, _ in replies), turns=turns
    )


def test_a_conversation_hit_max_new_when_any_of_its_replies_did() -> None:
    assert SampleRunner._hit_max_new(attempt(), conversation((MAX_NEW, LENGTH), (10, STOP)), False)
    assert not SampleRunner._hit_max_new(attempt(), conversation((12, STOP), (10, STOP)), False)


@pytest.mark.parametrize(
    ("meta", "reasoning"),
    [
        ({}, 0),
        ({"reasoning_tokens": 7}, 7),
        ({"reasoning_tokens": 99}, 10),  # never more than the completion's 10
        ({"reasoning_tokens": -1}, 0),
        ({"reasoning_tokens": None}, 0),
        ({"reasoning_tokens": "7"}, 0),
        ({"reasoning_tokens": True}, 0),
    ],
)
def test_reasoning_tokens_are_the_servers_count_within_the_completion(
    meta: dict[str, Any], reasoning: int
) -> None:
    assert gen(10, STOP, meta).reasoning_tokens == reasoning
