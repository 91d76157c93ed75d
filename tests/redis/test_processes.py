"""Starting a private Redis: the server that answers must be the one started, not whatever holds the port."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tokenfleet import processes
from tokenfleet.processes import RedisStartError, embedded_redis, redis_pid, start_redis

pytestmark = pytest.mark.redis


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


def test_a_redis_started_where_another_redis_listens_fails_instead_of_passing_for_it(tmp_path: Path) -> None:
    with embedded_redis(tmp_path / "first") as url:
        held_by = redis_pid(url)
        with pytest.raises(RedisStartError, match=f"port {port_of(url)}"):
            start_redis(tmp_path / "second", port_of(url))
        assert redis_pid(url) == held_by  # the first one still answers, untouched


def test_an_embedded_redis_whose_free_port_was_taken_meanwhile_starts_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with embedded_redis(tmp_path / "first") as taken:
        offered = iter([port_of(taken)])  # the first "free" port offered is the one taken
        real_free_port = processes.free_port
        monkeypatch.setattr(processes, "free_port", lambda: next(offered, None) or real_free_port())
        with embedded_redis(tmp_path / "second") as url:
            assert port_of(url) != port_of(taken)
            assert redis_pid(url) not in (None, redis_pid(taken))
