"""What the worker process logs of its HTTP calls."""

from __future__ import annotations

import logging

import httpx
import pytest

import workers.app  # noqa: F401  (sets the levels under test)


def test_the_workers_info_log_has_no_line_per_http_request_but_keeps_httpx_warnings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200)))
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            client.post("http://server.test/abort_request", json={"rid": "r"})
        logging.getLogger("httpx").warning("a warning from httpx")
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("httpx")]
    assert messages == ["a warning from httpx"]
