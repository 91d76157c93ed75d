"""Folding SGLang's streamed chunks: cumulative and incremental output_ids."""

from __future__ import annotations

import pytest

from workers.sglang.client import ProtocolError, StreamAccumulator, _error_message


def chunk(ids: list[int], completion: int, text: str = "", finish: dict[str, object] | None = None) -> dict:
    return {
        "output_ids": ids,
        "text": text,
        "meta_info": {"completion_tokens": completion, "finish_reason": finish},
    }


def test_cumulative_chunks_replace_the_output_and_count_only_new_tokens() -> None:
    acc = StreamAccumulator()
    assert acc.feed(chunk([5, 6], 2, "a b")) == 2
    assert acc.feed(chunk([5, 6, 7, 8], 4, "a b c d")) == 2
    assert acc.feed(chunk([5, 6, 7, 8, 2], 5, "a b c d", {"type": "stop", "matched": 2})) == 1
    assert acc.output_ids == [5, 6, 7, 8, 2]
    assert acc.text == "a b c d"
    assert acc.finished


def test_incremental_chunks_are_appended() -> None:
    acc = StreamAccumulator()
    assert acc.feed(chunk([5, 6], 2, "a b")) == 2
    assert acc.feed(chunk([7, 8], 4, " c d")) == 2
    assert acc.feed(chunk([2], 5, "", {"type": "stop", "matched": 2})) == 1
    assert acc.output_ids == [5, 6, 7, 8, 2]
    assert acc.text == "a b c d"


def test_a_delta_as_long_as_the_first_chunk_is_still_appended() -> None:
    acc = StreamAccumulator()
    acc.feed(chunk([1, 2, 3], 3))
    assert acc.feed(chunk([4, 5, 6], 6)) == 3
    assert acc.output_ids == [1, 2, 3, 4, 5, 6]


def test_an_answer_without_output_ids_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="output_ids"):
        StreamAccumulator().feed({"text": "hello", "meta_info": {"completion_tokens": 3}})


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"error": "unknown field `max_tokens`"}', "unknown field `max_tokens`"),
        (b'{"error": {"message": "The input (9000 tokens) is longer"}}', "The input (9000 tokens) is longer"),
        (b'{"object": "error", "message": "queue full", "code": 503}', "queue full"),
        (b"Bad Gateway", "Bad Gateway"),
    ],
)
def test_every_sglang_error_shape_yields_its_message(body: bytes, message: str) -> None:
    assert _error_message(body) == message
