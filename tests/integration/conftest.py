"""The fleet's real parts for integration tests: worker processes on a real Redis, the simulator over
real HTTP, and configs written to a temp folder.

The fleet uses its own Redis database (``TOKENFLEET_TEST_FLEET_REDIS_URL``, default db 14), flushed once
per session: worker processes and the Celery queue's routing keys live there for the whole session, so
tests keep apart by unique dataset names instead of flushing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from budget import Ledger
from tests.conftest import IN_CI
from tokenfleet.cli import main
from tokenfleet.processes import start_worker, stop_process, wait_for_workers
from tokenfleet.sim import SimConfig, SimServerThread

FLEET_REDIS_URL = os.environ.get("TOKENFLEET_TEST_FLEET_REDIS_URL", "redis://127.0.0.1:6379/14")
#: Short leases so a killed worker's samples come back within seconds in tests.
WORKER_ENV = {"TOKENFLEET_LEASE_S": "3", "TOKENFLEET_VISIBILITY_TIMEOUT_S": "60"}
WORKER_PROCESSES = 2
#: How long a test waits for the fleet to reach a state.
WAIT_S = 60
WORKER_CONCURRENCY = 8


@pytest.fixture(scope="session")
def fleet_redis_url() -> str:
    client = redis.Redis.from_url(FLEET_REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError as e:
        if IN_CI:
            raise
        pytest.skip(f"no Redis at {FLEET_REDIS_URL}: {e}")
    client.flushdb()
    client.close()
    return FLEET_REDIS_URL


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
def fleet_ledger(fleet_redis_url: str) -> Iterator[Ledger]:
    ledger = Ledger.from_url(fleet_redis_url)
    yield ledger
    ledger.client.close()


class Sim:
    """A running simulator with its stats."""

    def __init__(self, server: SimServerThread) -> None:
        self.server = server
        self.url = server.url
        key, admin = server.config.api_key, server.config.admin_api_key or server.config.api_key
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        #: The simulator's own /sim/ routes take the admin key when it has one.
        self.control_headers = {"Authorization": f"Bearer {admin}"} if admin else {}

    def stats(self) -> dict[str, Any]:
        reply = httpx.get(f"{self.url}/sim/stats", timeout=5, headers=self.control_headers)
        data: dict[str, Any] = reply.raise_for_status().json()
        return data

    def configure(self, **knobs: Any) -> None:
        httpx.post(
            f"{self.url}/sim/config", json=knobs, timeout=5, headers=self.control_headers
        ).raise_for_status()

    def generate(self, input_ids: list[int], sampling_params: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(
            f"{self.url}/generate",
            json={"input_ids": input_ids, "sampling_params": sampling_params},
            timeout=30,
            headers=self.headers,
        )
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data


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


def unique(name: str) -> str:
    return f"{name}_{uuid.uuid4().hex[:8]}"


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def toml_value(v: Any) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return str(v)


def write_config(
    folder: Path,
    *,
    redis_url: str,
    servers: list[str],
    datasets: list[dict[str, Any]],
    sampling: dict[str, Any] | None = None,
    top: dict[str, Any] | None = None,
) -> Path:
    """A TOML config; each dataset dict has name, rows (written to data/NAME.jsonl) and other keys."""
    lines = [f"redis_url = {toml_value(redis_url)}", 'output_dir = "out"']
    for k, v in (top or {}).items():
        lines.append(f"{k} = {toml_value(v)}")
    lines += ["", "[server]", f"urls = {toml_value(servers)}", "timeout_s = 60", "", "[sampling]"]
    for k, v in (sampling or {"max_new_tokens": 256}).items():
        lines.append(f"{k} = {toml_value(v)}")
    for ds in datasets:
        ds = dict(ds)
        rows = ds.pop("rows", None)
        ds_sampling = ds.pop("sampling", None)
        if rows is not None:
            write_jsonl(folder / "data" / f"{ds['name']}.jsonl", rows)
            ds.setdefault("path", f"data/{ds['name']}.jsonl")
        lines += ["", "[[dataset]]"] + [f"{k} = {toml_value(v)}" for k, v in ds.items()]
        if ds_sampling:
            lines += ["[dataset.sampling]"] + [f"{k} = {toml_value(v)}" for k, v in ds_sampling.items()]
    path = folder / "tokenfleet.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def wait_until(predicate: Callable[[], bool], timeout_s: float = WAIT_S, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class BackgroundSubmit:
    """``tokenfleet submit`` running in a thread, as an operator's terminal would."""

    def __init__(self, config: Path, *extra: str) -> None:
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, args=(config, extra), daemon=True)
        self.thread.start()

    def _run(self, config: Path, extra: tuple[str, ...]) -> None:
        self.code = main(["submit", str(config), "--no-server-check", *extra])

    def wait(self, timeout_s: float = WAIT_S) -> int:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "submit did not settle"
        assert self.code is not None
        return self.code


def submit_process(config: Path, *extra: str) -> subprocess.Popen[bytes]:
    """``tokenfleet submit CONFIG --no-server-check EXTRA`` in a process of its own (to be killed)."""
    argv = [sys.executable, "-m", "tokenfleet.cli", "submit", str(config), "--no-server-check", *extra]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


class PrivateFleet:
    """A Redis server, worker processes and nothing shared with other tests: for faults that kill or
    restart parts (a session-wide fleet must not be hurt by them)."""

    def __init__(
        self,
        folder: Path,
        redis_args: tuple[str, ...] = ("--save", "", "--appendonly", "no"),
        password: str | None = None,
    ) -> None:
        from tokenfleet.processes import free_port, start_redis

        self.folder = folder
        self.port = free_port()
        self.redis_args = redis_args + (("--requirepass", password) if password else ())
        self.url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{self.port}/0"
        self.redis = start_redis(folder / "redis", self.port, self.redis_args, url=self.url)
        self.workers: dict[str, subprocess.Popen[bytes]] = {}

    def start_worker(
        self, name: str, concurrency: int = 8, loglevel: str = "WARNING"
    ) -> subprocess.Popen[bytes]:
        proc = start_worker(
            self.url,
            concurrency=concurrency,
            name=name,
            env=WORKER_ENV,
            log_path=self.folder / f"{name}.log",
            loglevel=loglevel,
        )
        self.workers[name] = proc
        wait_for_workers(self.url, [name])
        return proc

    def restart_redis(self, down_s: float = 1.0) -> None:
        """SIGTERM (Redis writes its AOF on shutdown), wait, start it again on the same port and folder."""
        import time

        from tokenfleet.processes import start_redis

        self.redis.terminate()
        self.redis.wait(timeout=10)
        time.sleep(down_s)
        self.redis = start_redis(self.folder / "redis", self.port, self.redis_args, url=self.url)

    def ledger(self) -> Ledger:
        return Ledger.from_url(self.url)

    def close(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.redis.terminate()
        self.redis.wait(timeout=10)


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


def self_signed_certificate(folder: Path) -> Path:
    """``folder/cert.pem``, a self-signed certificate for 127.0.0.1 made with openssl (its key beside it,
    ``key.pem``); the caller checks that openssl is on this machine."""
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(folder / "key.pem"),
            "-out",
            str(folder / "cert.pem"),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return folder / "cert.pem"
