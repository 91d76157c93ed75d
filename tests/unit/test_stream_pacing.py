"""The stream pacer: intervals as long as stall detection allows, and short enough when the server slows."""

from __future__ import annotations

from budget.defaults import STREAM_INTERVAL_MIN
from workers.stream_pacing import StreamPacer

SERVER = "http://gpu-1:30000"
STALL_S = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_streams(pacer: StreamPacer, clock: Clock, n: int, tokens: int, seconds: float) -> None:
    """``n`` streams in flight on the server, the last opened answering ``tokens`` in ``seconds`` (the
    others end without an answer: aborted)."""
    streams = [pacer.open(SERVER, 4096, STALL_S) for _ in range(n)]
    clock.now += seconds
    pacer.finished(streams[-1], tokens)
    for paced in streams:
        pacer.close(paced)


def test_an_unmeasured_server_gets_short_chunks() -> None:
    pacer = StreamPacer(Clock())
    assert pacer.open(SERVER, 4096, STALL_S).interval == STREAM_INTERVAL_MIN
    assert pacer.open(SERVER, 10, STALL_S).interval == 10


def test_a_measured_fast_server_gets_a_chunk_every_quarter_of_the_stall_timeout() -> None:
    clock = Clock()
    pacer = StreamPacer(clock)
    run_streams(pacer, clock, 1, 500, 10.0)  # 50 tokens/s
    assert pacer.open(SERVER, 4096, STALL_S).interval == 50 * STALL_S / 4
    assert pacer.open(SERVER, 300, STALL_S).interval == 300  # at most max_new_tokens


def test_a_stream_opens_with_the_speed_one_stream_got_on_its_server() -> None:
    """What the worker counts a discard budget's running answers at between chunks (``Lease.reported``)."""
    clock = Clock()
    pacer = StreamPacer(clock)
    assert pacer.open(SERVER, 4096, STALL_S).speed == 0.0  # not measured yet
    run_streams(pacer, clock, 1, 2000, 10.0)
    assert pacer.open(SERVER, 4096, STALL_S).speed == 200.0


def test_the_expected_speed_falls_with_the_streams_in_flight() -> None:
    """Measured at 8 streams, the 64th stream open at once expects an eighth of the speed: a process
    ramping up never asks for chunks its server's larger batch cannot deliver within the stall timeout."""
    clock = Clock()
    pacer = StreamPacer(clock)
    run_streams(pacer, clock, 8, 1000, 10.0)  # 100 tokens/s each, 800 tokens/s in all
    alone = pacer.open(SERVER, 100_000, STALL_S)
    assert alone.interval == 100 * STALL_S / 4
    pacer.close(alone)
    ramp = [pacer.open(SERVER, 100_000, STALL_S) for _ in range(64)]
    assert ramp[-1].interval == int(800 / 64 * STALL_S / 4)
    # at the expected speed, its chunk comes well inside the stall timeout
    assert ramp[-1].interval / (800 / 64) < STALL_S


def test_a_slower_answer_lowers_the_estimate_faster_than_a_faster_one_raises_it() -> None:
    clock = Clock()
    pacer = StreamPacer(clock)
    run_streams(pacer, clock, 1, 1000, 10.0)  # 100 tokens/s
    run_streams(pacer, clock, 1, 200, 10.0)  # 20 tokens/s: the estimate falls half way
    fallen = pacer.open(SERVER, 100_000, STALL_S)
    pacer.close(fallen)
    assert fallen.interval == 60 * STALL_S / 4
    run_streams(pacer, clock, 1, 1000, 10.0)  # 100 tokens/s again: it rises a fifth of the way
    risen = pacer.open(SERVER, 100_000, STALL_S)
    assert risen.interval == (60 + 0.2 * 40) * STALL_S / 4


def test_a_stalled_stream_drops_the_estimate_to_what_it_saw() -> None:
    clock = Clock()
    pacer = StreamPacer(clock)
    run_streams(pacer, clock, 1, 1000, 10.0)
    paced = pacer.open(SERVER, 100_000, STALL_S)
    assert paced.interval == 1500
    pacer.heard(paced)  # its first token
    clock.now += STALL_S
    assert not pacer.stalled(paced, 1, STALL_S)  # nothing else came from the server: it may be wedged
    pacer.close(paced)
    assert pacer.open(SERVER, 100_000, STALL_S).interval == STREAM_INTERVAL_MIN


def test_a_stall_while_the_server_answers_other_streams_blames_the_interval() -> None:
    clock = Clock()
    pacer = StreamPacer(clock)
    run_streams(pacer, clock, 2, 1000, 10.0)
    slow, other = pacer.open(SERVER, 100_000, STALL_S), pacer.open(SERVER, 100_000, STALL_S)
    clock.now += STALL_S - 1
    pacer.heard(other)
    clock.now += 1
    assert pacer.stalled(slow, 1, STALL_S)


def test_the_stream_that_heard_a_wedged_server_last_counts_its_stall_against_it() -> None:
    """A wedged server's streams stall one by one, each a stall timeout after its own last chunk: the
    first ones still see the server's last chunk as recent, but the one that got it cannot."""
    clock = Clock()
    pacer = StreamPacer(clock)
    early, last = pacer.open(SERVER, 4096, STALL_S), pacer.open(SERVER, 4096, STALL_S)
    pacer.heard(early)
    clock.now += STALL_S * 0.6
    pacer.heard(last)  # the server wedges right after this chunk
    clock.now += STALL_S * 0.4
    assert pacer.stalled(early, 1, STALL_S)  # blamed on its interval (a short estimate follows)
    clock.now += STALL_S * 0.6 - 0.001  # its own read timed out: a stall timeout after its chunk, or about
    assert not pacer.stalled(last, 1, STALL_S)


def test_closing_twice_counts_the_stream_once() -> None:
    clock = Clock()
    pacer = StreamPacer(clock)
    run_streams(pacer, clock, 1, 1000, 10.0)  # 100 tokens/s
    paced = pacer.open(SERVER, 100_000, STALL_S)
    pacer.close(paced)
    pacer.close(paced)
    # one stream open again, not zero: the throughput divided by one
    assert pacer.open(SERVER, 100_000, STALL_S).interval == 100 * STALL_S / 4
