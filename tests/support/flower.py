"""A real Flower process (``celery -A workers.app flower``) on a free port, and its HTTP API as an operator's
browser or script uses it: the tasks it lists, and its Revoke button."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tokenfleet.processes import free_port

#: The basic auth the test Flower runs with (its API answers only with auth configured, or an env flag).
FLOWER_AUTH = ("tokenfleet", "flower-test")
START_TIMEOUT_S = 60.0


class Flower:
    def __init__(self, redis_url: str, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "workers.app",
                "flower",
                "--address=127.0.0.1",
                f"--port={self.port}",
                f"--basic-auth={FLOWER_AUTH[0]}:{FLOWER_AUTH[1]}",
                "--enable_events=True",
            ],
            env=dict(os.environ) | {"TOKENFLEET_REDIS_URL": redis_url},
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.http = httpx.Client(base_url=self.url, auth=FLOWER_AUTH, timeout=10)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"flower exited with {self.proc.returncode}: see {log_path}")
            try:
                if self.http.get("/healthcheck").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"flower did not answer in {START_TIMEOUT_S:.0f} s: see {log_path}")
            time.sleep(0.2)

    def tasks(self, *, state: str | None = None, search: str | None = None) -> dict[str, dict[str, Any]]:
        """``GET /api/tasks``: task id -> what Flower knows of it."""
        params = {k: v for k, v in {"state": state, "search": search}.items() if v is not None}
        reply = self.http.get("/api/tasks", params=params)
        reply.raise_for_status()
        tasks: dict[str, dict[str, Any]] = reply.json()
        return tasks

    def revoke(self, task_id: str, *, terminate: bool) -> None:
        """What Flower's Revoke (or Terminate) button sends."""
        self.http.post(
            f"/api/task/revoke/{task_id}", params={"terminate": str(terminate).lower()}
        ).raise_for_status()

    def close(self) -> None:
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def task_sample_ids(task: dict[str, Any]) -> list[str]:
    """The sample ids of a task as Flower shows its kwargs (``{'dataset': ..., 'sample_ids': [...]}``)."""
    kwargs = ast.literal_eval(task.get("kwargs") or "{}")
    if "sample_ids" in kwargs:
        return [str(s) for s in kwargs["sample_ids"]]
    return [str(kwargs["sample_id"])] if "sample_id" in kwargs else []
