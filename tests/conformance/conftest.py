"""Fixtures of the conformance suite: the real SGLang server (``real_server.py``), worker processes sized to
keep more requests in flight than the server runs, and cleanup of every dataset a test made.

The fleet's Redis is the integration suite's (``TOKENFLEET_TEST_FLEET_REDIS_URL``): its fixtures
(``fleet_redis_url``, ``fleet_ledger`` in ``tests/conftest.py``) are reused.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from budget import Ledger
from tests.conformance.helpers import ADMIN_KEY_ENV, API_KEY_ENV, ServerKeys, Workers
from tests.conformance.real_server import INSTALLED_MARKER, RealServer, default_port, default_root
from tests.support.env import WORKER_ENV
from tokenfleet.cli import main
from tokenfleet.processes import start_worker, stop_process, wait_for_workers

WORKER_PROCESSES = 2
#: Threads per worker process: 128 generations fleet-wide, more than any test's max_inflight_per_server.
WORKER_CONCURRENCY = 64


@pytest.fixture(scope="session")
def server_keys() -> ServerKeys:
    return ServerKeys(f"tfk-{secrets.token_hex(16)}", f"tfa-{secrets.token_hex(16)}")


def running(server: RealServer) -> Iterator[RealServer]:
    """A fixture's body: ``server`` up with its flags, then stopped if this run started it."""
    server.ensure()
    try:
        yield server
    finally:
        server.stop_if_started()


@pytest.fixture(scope="session")
def real_server() -> Iterator[RealServer]:
    """The recipe's server with metrics and the request log; reused if it already runs so."""
    server = RealServer(default_root(), default_port())
    yield from running(server)


@pytest.fixture
def live_server(real_server: RealServer) -> RealServer:
    """``real_server``, restarted first if an earlier test brought it down."""
    if not real_server.healthy():
        real_server.ensure()
    return real_server


def second_root(name: str) -> Path:
    """The recipe root of another server: a folder of its own (pid file, logs) that links the venv, the
    model and the install marker of the first (so it is installed exactly when the first is)."""
    base = default_root()
    root = base / name
    root.mkdir(parents=True, exist_ok=True)
    for shared in ("venv", "tiny-llama", INSTALLED_MARKER):
        link = root / shared
        if not link.is_symlink() and not link.exists():
            link.symlink_to(base / shared)
    return root


@pytest.fixture(scope="module")
def keyed_server(server_keys: ServerKeys) -> Iterator[RealServer]:
    """A second server, on the next port, with ``--api-key`` and ``--admin-api-key``."""
    server = RealServer(
        second_root("keyed"), default_port() + 1, server_keys.api_key, server_keys.admin_api_key
    )
    yield from running(server)


@pytest.fixture(scope="module")
def incremental_server() -> Iterator[RealServer]:
    """A third server, two ports on, with ``--incremental-streaming-output``: chunks carry deltas."""
    server = RealServer(second_root("incremental"), default_port() + 2, incremental=True)
    yield from running(server)


@pytest.fixture(scope="session")
def conformance_workers(
    fleet_redis_url: str, server_keys: ServerKeys, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Workers]:
    """Worker processes logging at INFO, with the keys of the ``--api-key`` server in their environment
    (workers read them from there; the ledger never holds them)."""
    logs = tmp_path_factory.mktemp("conformance-worker-logs")
    env = WORKER_ENV | {API_KEY_ENV: server_keys.api_key, ADMIN_KEY_ENV: server_keys.admin_api_key}
    names = [f"cw{i}-{uuid.uuid4().hex[:6]}" for i in range(WORKER_PROCESSES)]
    procs = [
        start_worker(
            fleet_redis_url,
            concurrency=WORKER_CONCURRENCY,
            name=name,
            env=env,
            log_path=logs / f"{name}.log",
            loglevel="INFO",
        )
        for name in names
    ]
    try:
        wait_for_workers(fleet_redis_url, names)
        yield Workers(procs, logs)
    finally:
        for p in procs:
            stop_process(p)


@pytest.fixture
def dataset_name(fleet_redis_url: str, fleet_ledger: Ledger) -> Iterator[Callable[[str], str]]:
    """Unique dataset names; at teardown each one still busy is revoked, so no test's leftovers reach the
    server during the next test."""
    made: list[str] = []

    def make(prefix: str) -> str:
        name = f"{prefix}_{uuid.uuid4().hex[:8]}"
        made.append(name)
        return name

    yield make
    known = set(fleet_ledger.datasets())
    for name in made:
        if name in known and not fleet_ledger.snapshot(name).settled:
            main(["revoke", name, "--redis-url", fleet_redis_url])
