"""The queue window submit keeps per dataset when the user sets none: enough for the servers' batch."""

from producer.feeder import DEFAULT_WINDOW
from tokenfleet.submit import queue_window


def test_the_default_window_holds_when_the_servers_run_fewer_or_their_caps_are_unknown() -> None:
    assert queue_window(None) == DEFAULT_WINDOW
    assert queue_window(64) == DEFAULT_WINDOW
    assert queue_window(DEFAULT_WINDOW) == DEFAULT_WINDOW


def test_the_window_grows_to_what_the_servers_run_at_once() -> None:
    # eight servers of 1,024: one feeder round of 512 would keep a sixteenth of their batch queued
    assert queue_window(8 * 1024) == 8 * 1024
    assert queue_window(DEFAULT_WINDOW + 1) == DEFAULT_WINDOW + 1
