"""A generation continued past its grant (workers/continuation.py): when a request ended at its grant, what
the next request sends, and how the pieces join into one generation."""

from __future__ import annotations

from dataclasses import replace

from workers.continuation import (
    REQUESTS_FIELD,
    can_continue,
    continued_prompt,
    ended_at_grant,
    joined,
    requests_taken,
)
from workers.conversation import ConversationGeneration
from workers.sglang.client import Generation


def gen(
    ids: list[int], reason: dict[str, object], *, prompt: int = 3, rid: str = "r1", **meta: int
) -> Generation:
    return Generation(
        rid=rid,
        server="http://s",
        output_ids=ids,
        text="".join(f"<{i}>" for i in ids),
        finish_reason=reason,
        prompt_tokens=prompt,
        completion_tokens=len(ids),
        meta_info={"completion_tokens": len(ids), "prompt_tokens": prompt, **meta},
    )


def test_a_request_ended_at_its_grant_only_with_a_length_finish_at_exactly_what_it_was_sent_with() -> None:
    length = {"type": "length", "length": 4}
    assert ended_at_grant(gen([5, 6, 7, 8], length), 4)
    assert not ended_at_grant(gen([5, 6, 7], length), 4)  # clamped to the context left: the answer's end
    assert not ended_at_grant(gen([5, 6, 7, 8], {"type": "stop", "matched": 2}), 4)
    assert not ended_at_grant(gen([5, 6, 7, 8], {"type": "abort", "message": "x"}), 4)


def test_a_continuation_sends_the_prompt_then_every_token_so_far() -> None:
    assert continued_prompt([1, 2, 3], gen([5, 6], {"type": "length"})) == [1, 2, 3, 5, 6]


def test_joined_pieces_read_as_one_generation_of_the_first_prompt_with_the_last_finish() -> None:
    first = gen([5, 6], {"type": "length", "length": 2}, reasoning_tokens=2)
    second = gen([7, 8, 9], {"type": "stop", "matched": 2}, prompt=5, rid="r2", reasoning_tokens=1)

    whole = joined(first, second)

    assert whole.output_ids == [5, 6, 7, 8, 9]
    assert whole.text == "<5><6><7><8><9>"
    assert (whole.prompt_tokens, whole.completion_tokens) == (3, 5)
    assert whole.finish_reason == {"type": "stop", "matched": 2}
    assert whole.rid == "r1"  # the record names the generation's first request
    assert whole.reasoning_tokens == 3
    assert whole.meta_info[REQUESTS_FIELD] == 2
    assert joined(whole, gen([1], {"type": "stop"}, prompt=8)).meta_info[REQUESTS_FIELD] == 3
    # a length finish says the generation's length, as one request with that max_new_tokens would
    capped = joined(first, gen([7, 8, 9], {"type": "length", "length": 3}, prompt=5))
    assert capped.finish_reason == {"type": "length", "length": 5}


def test_a_prompt_of_ids_can_be_continued_on_any_server_a_text_prompt_only_where_it_tokenizes() -> None:
    assert can_continue({"input_ids": [1, 2]})
    assert can_continue({"input_ids": [1, 2], "conversation": [{"role": "user", "content": "hi"}]})
    assert not can_continue({"text": "hello"})


def test_a_record_counts_one_request_per_grant_and_one_per_reply_of_a_conversation() -> None:
    one = gen([5, 6], {"type": "stop"})
    assert requests_taken(one) == 1
    assert requests_taken(joined(joined(one, gen([7], {"type": "stop"})), gen([8], {"type": "stop"}))) == 3
    replies = ConversationGeneration(
        rid="r1",
        server="http://s",
        output_ids=[1],
        text="x",
        finish_reason={"type": "stop"},
        prompt_tokens=3,
        completion_tokens=1,
        meta_info={},
        turns=[{"rid": "r1"}, {"rid": "r2"}],
    )
    assert requests_taken(replies) == 2
    # a conversation whose replies were continued says how many requests they took in all
    assert requests_taken(replace(replies, meta_info={REQUESTS_FIELD: 3})) == 3
