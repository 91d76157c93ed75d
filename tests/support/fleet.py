"""The fleet's parts as the tests drive them: the simulator over HTTP, ``tokenfleet submit`` (in this
process, in a thread or in a process of its own), a private Redis with its own workers, exports, rows."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from budget import Ledger
from tests.support.env import WAIT_S, WORKER_ENV
from tests.support.files import read_jsonl
from tokenfleet.cli import main
from tokenfleet.export import export_dataset
from tokenfleet.processes import free_port, start_redis, start_worker, wait_for_workers
from tokenfleet.sim import SimServerThread


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


def wait_until(predicate: Callable[[], bool], timeout_s: float = WAIT_S, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def submit(config: Path, *extra: str) -> int:
    """``tokenfleet submit CONFIG EXTRA`` in this process; its exit code."""
    return main(["submit", str(config), *extra])


class BackgroundSubmit:
    """``tokenfleet submit CONFIG --no-server-check EXTRA`` running in a thread, as an operator's terminal
    would."""

    def __init__(self, config: Path, *extra: str) -> None:
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, args=(config, extra), daemon=True)
        self.thread.start()

    def _run(self, config: Path, extra: tuple[str, ...]) -> None:
        self.code = submit(config, "--no-server-check", *extra)

    def wait(self, timeout_s: float = WAIT_S) -> int:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "submit did not settle"
        assert self.code is not None
        return self.code


def submit_process(config: Path, *extra: str) -> subprocess.Popen[bytes]:
    """``tokenfleet submit CONFIG --no-server-check EXTRA`` in a process of its own (to be killed)."""
    argv = [sys.executable, "-m", "tokenfleet.cli", "submit", str(config), "--no-server-check", *extra]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def text_rows(n: int, prefix: str = "prompt") -> list[dict[str, Any]]:
    return [
        {"id": f"{prefix}-{i}", "text": f"{prefix} number {i}: explain something", "topic": i % 3}
        for i in range(n)
    ]


def token_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    return [
        {"input_ids": [3 + (seed * 7919 + i * 31 + j) % 30000 for j in range(8 + i % 5)]} for i in range(n)
    ]


def export(ledger: Ledger, name: str, tmp_path: Path) -> list[dict[str, Any]]:
    """The dataset exported as tokens to ``tmp_path/exports/NAME.jsonl`` (none missing), read back."""
    report = export_dataset(ledger, name, tmp_path / "exports" / f"{name}.jsonl")
    assert report.missing == 0
    return read_jsonl(report.path)


class PrivateFleet:
    """A Redis server, worker processes and nothing shared with other tests: for faults that kill or
    restart parts (a session-wide fleet must not be hurt by them)."""

    def __init__(
        self,
        folder: Path,
        redis_args: tuple[str, ...] = ("--save", "", "--appendonly", "no"),
        password: str | None = None,
    ) -> None:
        self.folder = folder
        self.port = free_port()
        self.redis_args = redis_args + (("--requirepass", password) if password else ())
        self.url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{self.port}/0"
        self.redis = start_redis(folder / "redis", self.port, self.redis_args, url=self.url)
        self.workers: dict[str, subprocess.Popen[bytes]] = {}

    def start_worker(
        self, name: str, concurrency: int = 8, loglevel: str = "WARNING", env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        proc = start_worker(
            self.url,
            concurrency=concurrency,
            name=name,
            env=WORKER_ENV | (env or {}),
            log_path=self.folder / f"{name}.log",
            loglevel=loglevel,
        )
        self.workers[name] = proc
        wait_for_workers(self.url, [name])
        return proc

    def restart_redis(self, down_s: float = 1.0) -> None:
        """SIGTERM (Redis writes its AOF on shutdown), wait, start it again on the same port and folder."""
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
