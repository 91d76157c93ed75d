"""The fleet's real parts for integration tests: worker processes on a real Redis (the fleet's database,
``fleet_redis_url`` in ``tests/conftest.py``), the simulator over real HTTP, private fleets for faults that
kill parts. The helpers the tests call are in ``tests/support/``.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.env import WORKER_CONCURRENCY, WORKER_ENV, WORKER_PROCESSES
from tests.support.fleet import PrivateFleet, Sim
from tokenfleet.processes import start_worker, stop_process, wait_for_workers
from tokenfleet.sim import SimConfig, SimServerThread


@pytest.fixture(scope="session")
def workers(
    fleet_redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[subprocess.Popen[bytes]]]:
    logs = tmp_path_factory.mktemp("worker-logs")
    names = [f"w{i}-{uuid.uuid4().hex[:6]}" for i in range(WORKER_PROCESSES)]
    procs = [
        start_worker(
            fleet_redis_url,
            concurrency=WORKER_CONCURRENCY,
            name=name,
            env=WORKER_ENV,
            log_path=logs / f"{name}.log",
        )
        for name in names
    ]
    try:
        wait_for_workers(fleet_redis_url, names)
        yield procs
    finally:
        for p in procs:
            stop_process(p)


@pytest.fixture
def sim_factory() -> Iterator[Callable[..., Sim]]:
    started: list[SimServerThread] = []

    def make(**overrides: Any) -> Sim:
        config = SimConfig(**({"port": 0, "step_time_s": 0.002, "output_len_mean": 40.0} | overrides))
        server = SimServerThread(config)
        server.start()
        started.append(server)
        return Sim(server)

    yield make
    for s in started:
        s.stop()


@pytest.fixture
def sim(sim_factory: Callable[..., Sim]) -> Sim:
    return sim_factory()


@pytest.fixture
def private_fleet(tmp_path: Path) -> Iterator[Callable[..., PrivateFleet]]:
    made: list[PrivateFleet] = []

    def make(**kwargs: Any) -> PrivateFleet:
        fleet = PrivateFleet(tmp_path / f"fleet{len(made)}", **kwargs)
        made.append(fleet)
        return fleet

    yield make
    for fleet in made:
        fleet.close()
