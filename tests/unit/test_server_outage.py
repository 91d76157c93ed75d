"""A server that cannot be reached (nothing listens at its port: SGLang restarting, or stopped for good) is
no fault of the samples sent to it: which failures are such (``unreachable``), how a worker's picker waits
while every server of a dataset is dead here instead of sending requests that can only be refused, and how
the runner gives such a sample back without a strike. No Redis: the picker's ledger and the runner's are
stand-ins; the real fleet is in ``tests/integration/test_server_outage.py``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast
from unittest import mock

import pytest

from budget import GiveUpOutcome, Progress
from budget.server_board import Health
from budget.spec import DatasetSpec
from tests.support.attempts import attempt_of
from tokenfleet.processes import free_port
from workers.runner import SERVERS_DOWN, Attempt, SampleRunner
from workers.server_picker import ServerPicker, SlotWaitCancelled, unreachable
from workers.sglang.client import ServerUnavailable, SGLangClient, SGLangError

DEAD, OTHER = "http://127.0.0.1:1", "http://127.0.0.1:2"


def refused(server: str = DEAD) -> SGLangError:
    """What the client raises for a port nothing listens at: a real request to a closed port."""
    client = SGLangClient()
    try:
        client.generate(f"http://127.0.0.1:{free_port()}", rid="r", sampling_params={}, input_ids=[1])
    except SGLangError as e:
        e.server = server
        return e
    finally:
        client.close()
    raise AssertionError("a request to a closed port was answered")


def dropped() -> ServerUnavailable:
    """A stream cut mid-way (a live server that crashed or dropped it): a socket error, not a refusal."""
    try:
        raise ConnectionResetError(104, "Connection reset by peer")
    except ConnectionResetError:
        return ServerUnavailable(f"{DEAD}: ConnectionResetError", server=DEAD)


def test_a_refused_connection_is_unreachable_and_an_answer_or_a_dropped_stream_is_not() -> None:
    assert isinstance(refused(), ServerUnavailable) and unreachable(refused())
    assert not unreachable(dropped())
    assert not unreachable(ServerUnavailable("HTTP 503: busy", server=DEAD, status=503))
    assert not unreachable(ServerUnavailable("the stream ended before the generation finished"))


@pytest.fixture
def picker() -> Iterator[ServerPicker]:
    """A picker whose ledger answers every failure with the server marked down."""
    picker = ServerPicker(mock.MagicMock(), 1000)
    picker._clock_offset_ms = 0.0
    picker.board = mock.MagicMock()
    picker.board.report.return_value = Health(up=False, changed=False, fails=3)
    yield picker
    picker.close()


def board_of(picker: ServerPicker) -> mock.MagicMock:
    """The stand-in for the picker's ledger."""
    return cast(mock.MagicMock, picker.board)


def test_no_wait_while_some_server_is_not_dead_here(picker: ServerPicker) -> None:
    assert picker.wait_reachable([DEAD], 5.0)  # nothing known about it: tried
    picker.failed(DEAD, refused())
    started = time.monotonic()
    assert picker.wait_reachable([DEAD, OTHER], 5.0)
    picker.failed(OTHER, ServerUnavailable("HTTP 503: busy", server=OTHER, status=503))
    assert picker.wait_reachable([DEAD, OTHER], 5.0)  # down, but it answers: a strike's matter, not waited
    assert time.monotonic() - started < 0.5


def test_a_refused_server_marked_down_is_waited_for_a_bounded_time(picker: ServerPicker) -> None:
    picker.failed(DEAD, refused())
    started = time.monotonic()
    assert not picker.wait_reachable([DEAD], 0.3)
    assert 0.3 <= time.monotonic() - started < 1.0


def test_a_refusal_while_the_server_is_still_up_is_not_waited_for(picker: ServerPicker) -> None:
    board_of(picker).report.return_value = Health(up=True, changed=False, fails=1)
    picker.failed(DEAD, refused())
    assert picker.wait_reachable([DEAD], 5.0)


def test_a_wait_ends_once_the_dead_server_is_seen_up_again(picker: ServerPicker) -> None:
    picker.failed(DEAD, refused())
    board_of(picker).status.return_value = [mock.Mock(url=DEAD, up=True)]
    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(picker.wait_reachable([DEAD], 10.0)))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()
    started = time.monotonic()
    picker._refresh_dead()  # what the picker's thread does each tick: another worker's probe marked it up
    waiter.join(5)
    assert waited == [True] and time.monotonic() - started < 0.5


def test_a_wait_for_a_dead_server_ends_when_its_generation_is_stopped(picker: ServerPicker) -> None:
    picker.failed(DEAD, refused())
    with pytest.raises(SlotWaitCancelled):
        picker.wait_reachable([DEAD], 10.0, cancelled=lambda: True)


class FakePicker:
    """Every server dead after its first refusal: ``wait_reachable`` says so at once."""

    def __init__(self, dead: bool = False) -> None:
        self.dead = dead
        self.sent = 0

    def wait_reachable(self, servers: Any, timeout_s: float, cancelled: Any = None) -> bool:
        return not self.dead

    @contextmanager
    def use(self, servers: Any, **_: Any) -> Iterator[str]:
        self.sent += 1
        yield servers[0]

    def failed(self, server: str, failure: BaseException) -> None:
        pass


def runner_with(errors: list[SGLangError], dead_after: int | None = None) -> tuple[SampleRunner, Any]:
    """A runner whose client raises ``errors`` in turn; its picker finds every server dead once
    ``dead_after`` requests were sent."""
    ledger = mock.MagicMock()
    ledger.progress.return_value = (Progress.CONTINUE, "")
    ledger.give_up.return_value = GiveUpOutcome.PENDING
    client = mock.MagicMock()
    picker = FakePicker()

    def generate(*_: Any, **__: Any) -> None:
        if dead_after is not None and picker.sent >= dead_after:
            picker.dead = True
        raise errors.pop(0)

    client.generate.side_effect = generate
    runner = SampleRunner(ledger, client, mock.MagicMock(), mock.MagicMock(), 1000, sleep=lambda _: None)
    runner.picker = picker  # type: ignore[assignment]
    return runner, ledger


def attempt(max_attempts: int = 3) -> Attempt:
    spec = DatasetSpec(servers=(DEAD,), output_dir="", max_attempts=max_attempts, retry_min_span_s=0)
    return attempt_of(spec, sample={"input_ids": [5, 6]})


def test_retries_that_only_met_refused_connections_give_the_sample_back_without_a_strike() -> None:
    runner, ledger = runner_with([refused(), refused(), refused()])

    outcome = runner._generate(attempt())

    assert outcome.outcome == "dropped" and outcome.reason.startswith(f"{SERVERS_DOWN}: gave up after 3")
    ledger.release.assert_called_once_with("ds", "s1", "a1", SERVERS_DOWN)
    ledger.give_up.assert_not_called()


def test_a_dropped_stream_among_the_failures_still_counts_a_strike() -> None:
    runner, ledger = runner_with([dropped(), refused(), refused()])

    outcome = runner._generate(attempt())

    assert outcome.outcome == "dropped" and "server_unavailable" in outcome.reason
    ledger.give_up.assert_called_once()
    assert ledger.release.call_count == 0


def test_an_attempt_waits_out_a_dead_server_unsent_then_gives_the_sample_back_without_a_strike() -> None:
    runner, ledger = runner_with([refused()], dead_after=1)

    outcome = runner._generate(attempt(max_attempts=5))

    assert runner.picker.sent == 1  # type: ignore[attr-defined]  # only the request that found it dead
    assert outcome.reason.startswith(f"{SERVERS_DOWN}: every server down")
    ledger.release.assert_called_once_with("ds", "s1", "a1", SERVERS_DOWN)
    ledger.give_up.assert_not_called()
