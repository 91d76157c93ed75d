"""Splitting a streamed answer into lines (wire.py ``iter_lines``), however the bytes are cut."""

from __future__ import annotations

import random
from typing import Any

import pytest

from workers.sglang.wire import iter_lines


class Pieces:
    """Stands in for ``http.client.HTTPResponse.read1``: hands out the given pieces, then b""."""

    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = list(pieces)

    def read1(self, _n: int) -> bytes:
        return self._pieces.pop(0) if self._pieces else b""


def lines_of(pieces: list[bytes]) -> list[bytes]:
    response: Any = Pieces(pieces)
    return list(iter_lines(response))


STREAM = b'data: {"a": 1}\n\ndata: {"b": [1, 2]}\r\n\r\ndata: [DONE]\n\n'
LINES = [b'data: {"a": 1}', b"", b'data: {"b": [1, 2]}', b"", b"data: [DONE]", b""]


def test_whole_events_in_one_read_give_their_lines() -> None:
    assert lines_of([STREAM]) == LINES


@pytest.mark.parametrize("seed", range(20))
def test_lines_cut_anywhere_across_reads_come_out_whole(seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(STREAM)), rng.randint(1, 12)))
    pieces = [STREAM[a:b] for a, b in zip([0, *cuts], [*cuts, len(STREAM)], strict=True)]
    assert lines_of(pieces) == LINES


def test_one_byte_at_a_time_and_a_last_line_without_its_end() -> None:
    data = b"data: x\r\ndata: y"
    assert lines_of([data[i : i + 1] for i in range(len(data))]) == [b"data: x", b"data: y"]
