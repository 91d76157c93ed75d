"""A worker process's requests in flight (workers/stops.py): one tracked right after its dataset was found
stopped is stopped before it is sent, for a moment only."""

from __future__ import annotations

import time

import pytest

from workers import stops
from workers.stops import InflightRequests


def test_a_request_tracked_after_its_dataset_was_found_stopped_is_stopped_before_it_is_sent() -> None:
    inflight = InflightRequests()
    inflight.mark_stopped("ds", "revoked")

    with inflight.track("ds", "rid-1", "") as request, inflight.track("other", "rid-2", "") as other:
        assert request.handle.requested and request.handle.reason == "revoked"
        assert not other.handle.requested


def test_a_dataset_found_running_again_is_no_longer_stopped() -> None:
    inflight = InflightRequests()
    inflight.mark_stopped("ds", "paused")
    inflight.mark_stopped("ds", "")  # resumed

    with inflight.track("ds", "rid-1", "") as request:
        assert not request.handle.requested


def test_a_stop_found_long_ago_stops_no_new_request(monkeypatch: pytest.MonkeyPatch) -> None:
    inflight = InflightRequests()
    inflight.mark_stopped("ds", "paused")
    later = time.monotonic() + stops.STOPPED_FRESH_S + 1
    monkeypatch.setattr(stops.time, "monotonic", lambda: later)

    assert inflight.stopped("ds") == ""
    with inflight.track("ds", "rid-1", "") as request:
        assert not request.handle.requested
