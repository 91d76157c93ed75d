"""The real SGLang server of the conformance suite, run with the real-sglang recipe.

The recipe (``recipe.sh``; ``REAL_SGLANG_RECIPE`` names it) installs sglang 0.5.23 for the CPU into a venv
under ``REAL_SGLANG_ROOT`` (default ``~/.cache/real-sglang``, kept between runs), builds a tiny random-weight
Llama (vocabulary 2,048) and serves it. This module adds what the suite needs on top:

- the flags: ``--enable-metrics`` (``/metrics`` counts the tokens the server generated, the ground truth of
  budgets) and a JSON request log at level 3 (every request's rid, input ids and output ids, as the server
  saw and returned them, in ``ROOT/logs/requests``);
- reuse: a server already answering on the port with those flags is used as it is and left running; any
  other is (re)started through the recipe, and only what this run started is stopped at the end;
- reading the ground truth back: the generation counter, and the request log by rid.

``python -m tests.conformance.real_server install`` installs what is missing (nothing when the venv and the
model are there); ``make conformance`` calls it before the tests so no test waits for an install.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import httpx

#: The recipe in the ``shared/`` folder beside the checkout (where it lies on the team's machines and CI's).
DEFAULT_RECIPE: Final = str(Path(__file__).resolve().parents[3] / "shared" / "real-sglang" / "recipe.sh")
DEFAULT_PORT: Final = 31000
#: The recipe's own launch flags include ``--max-running-requests 32`` and ``--context-length 2048``.
MAX_RUNNING_REQUESTS: Final = 32
CONTEXT_LENGTH: Final = 2048
VOCAB_SIZE: Final = 2048
GENERATION_COUNTER: Final = "sglang:generation_tokens_total"
RUNNING_GAUGE: Final = "sglang:num_running_reqs"
QUEUED_GAUGE: Final = "sglang:num_queue_reqs"
#: How long the generation counter must stay still for the server to count as idle.
IDLE_CHECK_S: Final = 0.5
#: The recipe waits up to 300 s for /health; installing takes 3-4 minutes more.
RECIPE_TIMEOUT_S: Final = 900.0
HTTP_TIMEOUT_S: Final = 10.0
#: One generation, not streamed, answers only when it ends: with the stand-in kernel (torch_native attention,
#: CPUs without AVX-512) on 2 busy cores, 96 tokens took more than 10 s.
GENERATE_TIMEOUT_S: Final = 120.0


def recipe_path() -> Path:
    return Path(os.environ.get("REAL_SGLANG_RECIPE", DEFAULT_RECIPE))


def default_root() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("REAL_SGLANG_ROOT", f"{cache}/real-sglang"))


def default_port() -> int:
    return int(os.environ.get("REAL_SGLANG_PORT", str(DEFAULT_PORT)))


#: Written once the recipe's install step has finished: a venv left half-made by a killed install is not one.
INSTALLED_MARKER: Final = ".installed"
#: Held while installing: a second run on the machine (another checkout, CI) waits instead of installing too.
INSTALL_LOCK: Final = ".install.lock"


def installed(root: Path) -> bool:
    return (
        (root / INSTALLED_MARKER).exists()
        and (root / "venv" / "bin" / "python").exists()
        and (root / "tiny-llama" / "model.safetensors").exists()
    )


def install(root: Path, port: int) -> bool:
    """Install what is missing under ``root``, one process at a time on this machine; True if this call
    ran the recipe's install step (it does nothing when another process finished it meanwhile)."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / INSTALL_LOCK).open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"real sglang: another process is installing under {root}; waiting for it", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if installed(root):
            return False
        (root / INSTALLED_MARKER).unlink(missing_ok=True)
        run_recipe(root, port, "install")
        (root / INSTALLED_MARKER).write_text(f"{datetime.now().isoformat()}\n")
        return True


def run_recipe(root: Path, port: int, step: str, extra_args: str = "") -> None:
    """One step of the recipe (``install``, ``serve``, ``stop``); its output goes to ``ROOT/logs``."""
    root.mkdir(parents=True, exist_ok=True)
    log = root / "logs" / f"recipe-{step}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ) | {"ROOT": str(root), "PORT": str(port), "STEP": step, "EXTRA_ARGS": extra_args}
    with log.open("wb") as out:
        done = subprocess.run(
            ["bash", str(recipe_path())],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=RECIPE_TIMEOUT_S,
            check=False,
        )
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"recipe.sh STEP={step} failed ({done.returncode}), {log}:\n{tail}")


@dataclass(frozen=True)
class RequestRecord:
    """One request as the server's request log tells it."""

    rid: str
    received_at: float | None = None
    input_ids: list[int] | None = None
    text: str | None = None
    finished_at: float | None = None
    output_ids: list[int] | None = None
    finish_reason: dict[str, Any] | None = None
    completion_tokens: int | None = None
    #: When the server had the request's end from its scheduler (``meta_info.request_finished_ts``, SGLang
    #: 0.5.23), before its log line was written: ``finished_at`` is the line's time, and a server writing
    #: the lines of 64 aborted requests at once wrote them 5-16 ms apart on 2 busy cores.
    ended_at: float | None = None

    @property
    def end(self) -> float | None:
        """When it ended: the server's own time where its log gives one, else its log line's."""
        return self.ended_at or self.finished_at


def _epoch(iso: str) -> float:
    # The server writes datetime.now().isoformat(): local time of this machine, like time.time()'s.
    return datetime.fromisoformat(iso).timestamp()


@dataclass
class RealServer:
    """A real SGLang server on ``127.0.0.1:port`` started by the recipe under ``root``."""

    root: Path
    port: int
    api_key: str | None = None
    admin_api_key: str | None = None
    #: ``--incremental-streaming-output``: streamed chunks carry deltas of ``output_ids``, not the whole.
    incremental: bool = False
    started: bool = field(default=False, init=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def request_log_dir(self) -> Path:
        return self.root / "logs" / "requests"

    def extra_args(self) -> str:
        args = [
            "--enable-metrics",
            "--log-requests",
            "--log-requests-level 3",
            "--log-requests-format json",
            f"--log-requests-target {self.request_log_dir}",
        ]
        if self.api_key:
            args.append(f"--api-key {self.api_key}")
        if self.admin_api_key:
            args.append(f"--admin-api-key {self.admin_api_key}")
        if self.incremental:
            args.append("--incremental-streaming-output")
        return " ".join(args)

    def _headers(self, admin: bool = False) -> dict[str, str]:
        key = self.admin_api_key if admin and self.admin_api_key else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def server_info(self) -> dict[str, Any] | None:
        """``/server_info`` with our key, or None when nothing answers it as we expect."""
        try:
            r = httpx.get(f"{self.url}/server_info", headers=self._headers(), timeout=HTTP_TIMEOUT_S)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        info: dict[str, Any] = r.json()
        return info

    def has_our_flags(self) -> bool:
        info = self.server_info()
        if info is None:
            return False
        wanted: Mapping[str, Any] = {
            "enable_metrics": True,
            "log_requests": True,
            "log_requests_level": 3,
            "log_requests_format": "json",
            "log_requests_target": [str(self.request_log_dir)],
            "max_running_requests": MAX_RUNNING_REQUESTS,
            "context_length": CONTEXT_LENGTH,
            "api_key": self.api_key,
            "admin_api_key": self.admin_api_key,
            "incremental_streaming_output": self.incremental,
        }
        return all(info.get(k) == v for k, v in wanted.items())

    def ensure(self) -> None:
        """Reuse the server answering with our flags, else (re)start the recipe's with them."""
        if self.has_our_flags():
            return
        if not installed(self.root):
            install(self.root, self.port)
        # A fresh server: its request log starts empty (the handler appends, and rotates hourly).
        if self.request_log_dir.exists():
            for old in self.request_log_dir.iterdir():
                old.unlink()
        run_recipe(self.root, self.port, "serve", self.extra_args())
        self.started = True
        if not self.has_our_flags():
            raise RuntimeError(f"the server on {self.url} does not run with {self.extra_args()}")

    def stop_if_started(self) -> None:
        if self.started:
            run_recipe(self.root, self.port, "stop")
            self.started = False

    def pid(self) -> int | None:
        """The server's process id, as the recipe wrote it (None if it is gone)."""
        try:
            pid = int((self.root / "server.pid").read_text().strip())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        return pid

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> dict[str, float]:
        """Each metric's value, summed over its labels."""
        text = httpx.get(f"{self.url}/metrics", timeout=HTTP_TIMEOUT_S).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            values[name] = values.get(name, 0.0) + float(value)
        return values

    def generate(self, input_ids: list[int], sampling_params: Mapping[str, Any]) -> list[int]:
        """The output ids of one generation, not streamed."""
        r = httpx.post(
            f"{self.url}/generate",
            json={"input_ids": input_ids, "sampling_params": dict(sampling_params)},
            headers=self._headers(),
            timeout=GENERATE_TIMEOUT_S,
        )
        r.raise_for_status()
        return [int(i) for i in r.json()["output_ids"]]

    def generated_tokens(self) -> int:
        """Output tokens the server generated since it started (counted as each request ends, aborted and
        closed ones included)."""
        return int(self.metrics().get(GENERATION_COUNTER, 0.0))

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Until the server runs and queues nothing, and its generation counter stays still for a while."""
        deadline = time.monotonic() + timeout_s
        last: float | None = None
        while time.monotonic() < deadline:
            m = self.metrics()
            busy = m[RUNNING_GAUGE] + m[QUEUED_GAUGE]
            if busy == 0 and m.get(GENERATION_COUNTER, 0.0) == last:
                return
            last = m.get(GENERATION_COUNTER, 0.0) if busy == 0 else None
            time.sleep(IDLE_CHECK_S)
        raise AssertionError(f"the server on {self.url} is still busy after {timeout_s} s")

    def _log_events(self, needle: str) -> Iterator[dict[str, Any]]:
        if not self.request_log_dir.exists():
            return
        for path in sorted(self.request_log_dir.iterdir()):
            with path.open(encoding="utf-8") as f:
                for line in f:
                    if needle not in line:
                        continue
                    _, _, body = line.partition("] ")
                    yield json.loads(body)

    def requests(self, rid_prefix: str) -> dict[str, RequestRecord]:
        """Every logged request whose rid starts with ``rid_prefix`` (a dataset's tag), by rid."""
        found: dict[str, RequestRecord] = {}
        for event in self._log_events(f'"rid": "{rid_prefix}'):
            rid = str(event["rid"])
            if not rid.startswith(rid_prefix):
                continue
            seen = found.get(rid) or RequestRecord(rid)
            if event["event"] == "request.received":
                obj = event["obj"]
                seen = replace(
                    seen,
                    received_at=_epoch(event["timestamp"]),
                    input_ids=obj.get("input_ids"),
                    text=obj.get("text"),
                )
            elif event["event"] == "request.finished":
                out = event.get("out") or {}
                meta = out.get("meta_info") or {}
                seen = replace(
                    seen,
                    input_ids=seen.input_ids or event["obj"].get("input_ids"),
                    finished_at=_epoch(event["timestamp"]),
                    output_ids=out.get("output_ids"),
                    finish_reason=meta.get("finish_reason"),
                    completion_tokens=meta.get("completion_tokens"),
                    ended_at=meta.get("request_finished_ts"),
                )
            found[rid] = seen
        return found


#: The trainer the conformance suite loads exports with (``tests/conformance/test_trainers.py``), installed
#: into the server's venv (which already has torch and transformers): SpecForge without its dependencies,
#: plus ``datasets``, which its data code imports.
SPECFORGE_VERSION: Final = "0.2.0"


def install_specforge(root: Path) -> None:
    """Install SpecForge's data code into the server's venv, unless it is there already."""
    python = str(root / "venv" / "bin" / "python")
    probe = (
        "import importlib.metadata as m, specforge.data.prompt_builder, specforge.data.preprocessing; "
        f"assert m.version('specforge') == {SPECFORGE_VERSION!r}"
    )
    if subprocess.run([python, "-c", probe], capture_output=True, check=False).returncode == 0:
        return
    pip = [python, "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--no-deps", f"specforge=={SPECFORGE_VERSION}"], check=True)
    subprocess.run([*pip, "datasets"], check=True)


def main(argv: list[str]) -> int:
    root, port = default_root(), default_port()
    if argv == ["install"]:
        if installed(root):
            print(f"real sglang: installed under {root}")
        else:
            started = time.monotonic()
            print(f"real sglang: installing under {root} (3-4 minutes, once; log {root}/logs)", flush=True)
            if install(root, port):
                print(f"real sglang: installed in {time.monotonic() - started:.0f} s")
        install_specforge(root)
        return 0
    if argv == ["stop"]:
        run_recipe(root, port, "stop")
        return 0
    print("usage: python -m tests.conformance.real_server install|stop", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
