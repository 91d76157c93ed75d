"""What submit tells the workers about each server's cap (``dataset_spec``), against a real simulator."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.files import write_config
from tokenfleet.config import ConfigError, load_config
from tokenfleet.sim import SimConfig, SimServerThread
from tokenfleet.submit import dataset_spec

DOWN = "http://127.0.0.1:1"


@pytest.fixture
def sim() -> Iterator[SimServerThread]:
    with SimServerThread(SimConfig(port=0, max_running_requests=7)) as server:
        yield server


def spec_caps(tmp_path: Path, servers: list[str], cap: int | None = None) -> dict[str, int | None]:
    config = write_config(
        tmp_path,
        redis_url="redis://127.0.0.1:6379/0",
        servers=servers,
        datasets=[{"name": "ds", "rows": [{"input_ids": [5, 6, 7]}]}],
    )
    if cap is not None:
        text = config.read_text().replace(
            "timeout_s = 60\n", f"timeout_s = 60\nmax_inflight_per_server = {cap}\n"
        )
        config.write_text(text)
    return dict(dataset_spec(load_config(config, env={}), "ds").max_inflight_per_server)


def test_each_servers_default_cap_is_its_max_running_requests_and_a_silent_server_gets_none(
    sim: SimServerThread, tmp_path: Path
) -> None:
    assert spec_caps(tmp_path, [sim.url, DOWN]) == {sim.url: 7, DOWN: None}


def test_max_inflight_per_server_sets_the_same_cap_on_every_server(
    sim: SimServerThread, tmp_path: Path
) -> None:
    assert spec_caps(tmp_path, [sim.url, DOWN], cap=3) == {sim.url: 3, DOWN: 3}


def test_max_inflight_per_server_must_be_a_positive_integer(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_inflight_per_server"):
        spec_caps(tmp_path, [DOWN], cap=0)
