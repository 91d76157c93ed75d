"""``make compose-check``: the default ``compose.yaml`` stack on a real Docker engine, checked as users do.

1. ``docker compose build``, then ``docker compose up -d``: the producer submits ``compose/config/demo.toml``
   and must exit 0 (settled) with no warning in its log (the vocabulary is learnt from the simulator's model
   folder). Flower answers with its basic auth and refuses without; the metrics server lists both datasets
   with the ledger's tokens; ``tokenfleet status`` inside the stack says both are settled; ``tokenfleet
   export`` inside the stack gives one record per sample, with the ledger's tokens.
2. ``--scale worker=2``, and the producer service on a longer dataset (a config in a temp folder): its
   ``tokenfleet submit`` is killed inside the container (a crash), Docker restarts it (``restart:
   on-failure``) and it resumes; then ``docker compose run --rm --no-deps producer tokenfleet revoke NAME``
   stops the dataset, and the producer exits 0.
3. ``docker compose down`` (volumes kept), ``docker compose up -d``: the ledger is back from Redis's
   append-only file, the datasets as they were, and the producer exits 0 again without generating anything.

Runs under a project name of its own (``tokenfleet-check-XXXX``), with free host ports, an env file of its
own (a developer's ``.env`` is not read) and an image tag of its own; ``docker compose down -v`` and the
image's removal at the end, also on failure. Exit 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenfleet.processes import free_port

REPO: Final = Path(__file__).resolve().parents[1]
DEMO_DATASETS: Final = ("demo_budget", "demo_capped")
#: What the demo config asks (compose/config/demo.toml).
DEMO_BUDGET_TOKENS: Final = 4000
DEMO_CAPPED_SAMPLES: Final = 20
#: The longer dataset: prompts of this many tokens each (ignore_eos), 2.6 s apiece at the simulator's 10 ms
#: step, 256 at once (its default batch size): about a minute in all, if it were not revoked.
LONG_PROMPTS: Final = 6000
LONG_TOKENS: Final = 256
JOB_TIMEOUT_S: Final = 300.0
#: A revoked dataset commits no token later than this after the command returned (queued tasks are purged,
#: in-flight generations aborted), measured by a status poll every second.
REVOKE_STOPS_WITHIN_S: Final = 5.0
COMMAND_TIMEOUT_S: Final = 600.0
#: What compose.yaml reads (.env.example lists it all) comes from the check's own env file, not from this
#: shell, except where the build gets its base image and packages (a machine's mirror applies).
STACK_VARIABLES: Final = frozenset(
    re.findall(r"^#? ?([A-Z][A-Z0-9_]*)=", (REPO / ".env.example").read_text(), flags=re.MULTILINE)
) - {"PYTHON_IMAGE", "PIP_INDEX_URL"}
T = TypeVar("T")


class CheckFailed(Exception):
    pass


def log(message: str) -> None:
    print(f"[compose-check {time.strftime('%H:%M:%S')}] {message}", flush=True)


@contextmanager
def stage(name: str, times: dict[str, float]) -> Iterator[None]:
    log(f"{name} ...")
    started = time.monotonic()
    try:
        yield
    finally:
        times[name] = time.monotonic() - started
        log(f"{name}: {times[name]:.1f} s")


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float, every_s: float = 1.0) -> T:
    """Until ``probe`` returns something other than None (or raise after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise CheckFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


def check(ok: bool, message: str) -> None:
    if not ok:
        raise CheckFailed(message)
    log(f"ok: {message}")


@dataclass
class Stack:
    """``docker compose`` on this checkout, under a project name, env file and image tag of its own."""

    project: str
    env_file: Path
    image: str
    flower_port: int
    metrics_port: int
    flower_auth: tuple[str, str]
    overrides: dict[str, str] = field(default_factory=dict)

    def compose(self, *args: str, check: bool = True, timeout: float = COMMAND_TIMEOUT_S) -> str:
        argv = ["docker", "compose", "--project-directory", str(REPO), "-p", self.project]
        argv += ["--env-file", str(self.env_file), *args]
        env = {
            k: v for k, v in os.environ.items() if k not in STACK_VARIABLES and not k.startswith("COMPOSE_")
        } | self.overrides
        done = subprocess.run(
            argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise CheckFailed(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
        return done.stdout

    def container(self, service: str) -> dict[str, Any] | None:
        """``docker inspect`` of the service's container (its first one), or None before it exists."""
        ids = self.compose("ps", "--all", "-q", service).split()
        if not ids:
            return None
        out = subprocess.run(["docker", "inspect", ids[0]], capture_output=True, text=True, check=True)
        found: list[dict[str, Any]] = json.loads(out.stdout)
        return found[0]

    def status(self) -> dict[str, Any]:
        out = self.compose("exec", "-T", "worker", "tokenfleet", "status", "--json", timeout=60)
        body: dict[str, Any] = json.loads(out)
        return body

    def datasets(self) -> dict[str, dict[str, Any]]:
        return {d["name"]: d for d in self.status()["datasets"]}

    def flower(self, path: str, auth: tuple[str, str] | None = None) -> httpx.Response:
        return httpx.get(f"http://127.0.0.1:{self.flower_port}{path}", auth=auth, timeout=10)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        return {
            s.labels["dataset"]: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "tokenfleet_dataset_tokens"
        }


def exited(stack: Stack, service: str) -> dict[str, Any] | None:
    """The service's container state once it exited for good (not restarting), else None."""
    info = stack.container(service)
    if info is None:
        return None
    state: dict[str, Any] = info["State"]
    if state["Status"] == "exited" and not state["Restarting"]:
        return state | {"RestartCount": info.get("RestartCount", 0)}
    return None


def wait_producer_exit_0(stack: Stack) -> dict[str, Any]:
    state = wait_for("the producer to exit", lambda: exited(stack, "producer"), JOB_TIMEOUT_S)
    logs = stack.compose("logs", "--no-color", "producer")
    check(state["ExitCode"] == 0, f"the producer exited 0 (exit code {state['ExitCode']})")
    warnings = [line for line in logs.splitlines() if "warning" in line.lower()]
    check(not warnings, "the producer's log has no warning" + (f": {warnings}" if warnings else ""))
    return state


def check_settled_demo(stack: Stack) -> dict[str, dict[str, Any]]:
    datasets = stack.datasets()
    check(set(DEMO_DATASETS) <= set(datasets), f"tokenfleet status lists {sorted(datasets)}")
    for name in DEMO_DATASETS:
        d = datasets[name]
        check(d["settled"] and d["samples"] > 0, f"status: {name} settled, {d['samples']} samples")
    budget, capped = datasets["demo_budget"], datasets["demo_capped"]
    check(
        budget["state"] == "exhausted" and 0 < budget["tokens"] <= DEMO_BUDGET_TOKENS,
        f"status: demo_budget {budget['state']} at {budget['tokens']} of {DEMO_BUDGET_TOKENS} tokens",
    )
    check(capped["samples"] == DEMO_CAPPED_SAMPLES, f"status: demo_capped has {capped['samples']} samples")
    return datasets


def check_flower(stack: Stack) -> None:
    anonymous = stack.flower("/").status_code
    wrong = stack.flower("/", (stack.flower_auth[0], "wrong")).status_code
    right = stack.flower("/", stack.flower_auth).status_code
    check(
        (anonymous, wrong, right) == (401, 401, 200),
        f"Flower: {anonymous} anonymous, {wrong} wrong password, {right} with its basic auth",
    )
    tasks = stack.flower("/api/tasks?search=kwargs:dataset=demo_capped", stack.flower_auth).json()
    check(bool(tasks), f"Flower found {len(tasks)} tasks of demo_capped by dataset")


def check_metrics(stack: Stack, datasets: dict[str, dict[str, Any]]) -> None:
    tokens = stack.metrics()
    wanted = {n: float(datasets[n]["tokens"]) for n in DEMO_DATASETS}
    check(
        {n: tokens.get(n) for n in DEMO_DATASETS} == wanted,
        f"metrics: tokenfleet_dataset_tokens {wanted} as the ledger says",
    )


def check_export(stack: Stack, datasets: dict[str, dict[str, Any]]) -> None:
    for name in DEMO_DATASETS:
        path = f"/out/exports/{name}.jsonl"
        stack.compose("exec", "-T", "worker", "tokenfleet", "export", name, "-o", path, timeout=120)
        records = [
            json.loads(line) for line in stack.compose("exec", "-T", "worker", "cat", path).splitlines()
        ]
        tokens = sum(r["completion_tokens"] for r in records)
        ids = {r["id"] for r in records}
        check(
            len(records) == len(ids) == datasets[name]["samples"]
            and tokens == datasets[name]["tokens"]
            and all(r["output_ids"] and r["dataset"] == name for r in records),
            f"export {name}: {len(records)} records, each once, {tokens} tokens as the ledger says",
        )


def long_config(folder: Path, name: str) -> int:
    """A config of one longer dataset in ``folder``, readable by the image's user; its number of prompts."""
    (folder / "data").mkdir(parents=True)
    lines = [
        json.dumps({"id": f"long-{i:05d}", "text": f"Tell a long story, number {i}."})
        for i in range(LONG_PROMPTS)
    ]
    (folder / "data" / "long.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "long.toml").write_text(
        f'redis_url = "redis://redis:6379/0"\noutput_dir = "/out"\n\n[server]\nurls = ["http://sim:30000"]\n\n'
        f"[sampling]\nmax_new_tokens = {LONG_TOKENS}\nignore_eos = true\n\n"
        f'[[dataset]]\nname = "{name}"\npath = "data/long.jsonl"\n'
    )
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return LONG_PROMPTS


def kill_submit(stack: Stack) -> None:
    """SIGKILL to ``tokenfleet submit`` inside the producer's container (the child of its init): a crash."""
    code = (
        "import os, signal\n"
        "for p in filter(str.isdigit, os.listdir('/proc')):\n"
        "    if int(open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[1]) == 1:\n"
        "        os.kill(int(p), signal.SIGKILL)\n"
    )
    stack.compose("exec", "-T", "producer", "python", "-c", code)


def follow_until_exited(stack: Stack, name: str, since: float) -> list[tuple[float, dict[str, Any]]]:
    """The dataset's figures every second from ``since`` (monotonic) until the producer exited, logged."""
    timeline: list[tuple[float, dict[str, Any]]] = []
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        d = stack.datasets()[name]
        at = time.monotonic() - since
        if not timeline or any(
            d[k] != timeline[-1][1][k] for k in ("tokens", "samples", "inflight", "state")
        ):
            log(
                f"  +{at:5.1f} s: {d['state']}, {d['tokens']} tokens, {d['samples']} samples, "
                f"{d['inflight']} in flight, {d['queued']} queued, settled {d['settled']}"
            )
        timeline.append((at, d))
        if exited(stack, "producer") is not None:
            return timeline
        time.sleep(1.0)
    raise CheckFailed(f"the producer of {name} still runs {JOB_TIMEOUT_S:.0f} s after the revoke")


def worker_hosts(stack: Stack) -> set[str] | None:
    """The containers with a worker online (a worker container runs one process per core: names
    ``worker@HOST``, ``worker-1@HOST``, ...), once there are two."""
    hosts = {str(w["name"]).rpartition("@")[2] for w in stack.status()["workers"]}
    return hosts if len(hosts) >= 2 else None


def run_long_dataset_with_a_crash_and_a_revoke(stack: Stack, folder: Path) -> None:
    name = f"check_long_{secrets.token_hex(3)}"
    prompts = long_config(folder, name)
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() - 1))
    stack.overrides |= {"TOKENFLEET_CONFIG_DIR": str(folder), "TOKENFLEET_CONFIG": "long.toml"}
    stack.compose("up", "-d", "--scale", "worker=2", "producer")
    containers = stack.compose("ps", "-q", "worker").split()
    hosts = wait_for("workers online in two containers", lambda: worker_hosts(stack), 120)
    check(
        len(containers) == len(hosts) == 2, f"--scale worker=2: workers online in containers {sorted(hosts)}"
    )

    def running() -> dict[str, Any] | None:
        d = stack.datasets().get(name)
        return d if d and d["inflight"] > 0 and d["samples"] > 0 else None

    before = wait_for(f"{name} to run", running, 120)
    kill_submit(stack)
    restarted = wait_for(
        "Docker to restart the producer",
        lambda: (
            i
            if (i := stack.container("producer")) and i["RestartCount"] >= 1 and i["State"]["Running"]
            else None
        ),
        60,
    )
    log(
        f"ok: the producer, killed at {before['samples']} samples, was restarted by Docker "
        f"(restart count {restarted['RestartCount']})"
    )
    # More samples than were done, in flight or queued when it was killed: the restarted submit fed them.
    fed_before = before["samples"] + before["inflight"] + before["queued"]
    resumed = wait_for(
        f"{name} to go on after the restart",
        lambda: d if (d := stack.datasets()[name])["samples"] > fed_before else None,
        120,
    )
    check(
        not resumed["settled"],
        f"{name} resumed: {resumed['samples']} samples, more than the {fed_before} done, in flight or "
        f"queued at the crash, of {prompts}",
    )
    # --no-deps: `run` without it brings the producer's dependencies to the file's state, which scales the
    # workers back to one (the other stops gracefully: its generations run to their end first).
    revoking = time.monotonic()
    said = stack.compose("run", "--rm", "--no-deps", "producer", "tokenfleet", "revoke", name, timeout=120)
    log(f"revoke ({time.monotonic() - revoking:.1f} s): {said.strip()}")
    revoked = time.monotonic()
    timeline = follow_until_exited(stack, name, revoked)
    state = wait_for("the producer to exit", lambda: exited(stack, "producer"), 10)
    check(state["ExitCode"] == 0, f"the producer of {name} exited 0 after the revoke ({state['ExitCode']})")
    changes = [
        at
        for (at, d), (_, prev) in zip(timeline[1:], timeline, strict=False)
        if d["tokens"] != prev["tokens"]
    ]
    check(
        max(changes, default=0.0) <= REVOKE_STOPS_WITHIN_S,
        f"{name}: no token committed later than {max(changes, default=0.0):.1f} s after the revoke command "
        f"returned (bound {REVOKE_STOPS_WITHIN_S:.0f} s); settled after {timeline[-1][0]:.1f} s",
    )
    after = stack.datasets()[name]
    time.sleep(3)
    later = stack.datasets()[name]
    check(
        after["state"] == "revoked"
        and after["settled"]
        and later["tokens"] == after["tokens"]
        and after["samples"] < prompts,
        f"{name} {after['state']}, settled {after['settled']}, with {after['samples']} of {prompts} samples; "
        "its tokens stay at "
        f"{after['tokens']}",
    )
    still = stack.compose("ps", "-q", "worker").split()
    check(sorted(still) == sorted(containers), f"both worker containers still run after the revoke: {still}")
    for container in containers:
        logs = subprocess.run(
            ["docker", "logs", "--since", since, container], capture_output=True, text=True, check=True
        )
        received = (logs.stdout + logs.stderr).count("] received")
        check(received > 0, f"worker container {container[:12]} took {received} tasks of {name}")
    stack.overrides.clear()


def check_ledger_survives_down(stack: Stack, before: dict[str, dict[str, Any]]) -> None:
    stack.compose("down")
    volumes = subprocess.run(
        ["docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={stack.project}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    check(f"{stack.project}_redis-data" in volumes, f"docker compose down kept the volumes {volumes}")
    stack.compose("up", "-d")
    wait_producer_exit_0(stack)
    after = stack.datasets()
    aof = stack.compose("exec", "-T", "redis", "redis-cli", "config", "get", "appendonly").split()
    check(aof[-1] == "yes", "Redis runs with appendonly yes")
    keys = ("state", "tokens", "samples", "settled")
    check(
        all({k: after[n][k] for k in keys} == {k: before[n][k] for k in keys} for n in before),
        f"after down and up the ledger has every dataset as it was: {sorted(before)}",
    )


def run(stack: Stack, times: dict[str, float], scratch: Path) -> None:
    with stage("build", times):
        stack.compose("build", timeout=1200)
    with stage("up, producer to exit 0", times):
        stack.compose("up", "-d")
        wait_producer_exit_0(stack)
    with stage("checks: Flower, metrics, status, export", times):
        datasets = check_settled_demo(stack)
        check_flower(stack)
        check_metrics(stack, datasets)
        check_export(stack, datasets)
    with stage("scale worker=2, a longer dataset: crash, restart, revoke", times):
        run_long_dataset_with_a_crash_and_a_revoke(stack, scratch / "long")
    with stage("down and up: the ledger from its volume", times):
        check_ledger_survives_down(stack, stack.datasets())


def write_env_file(path: Path, values: dict[str, str]) -> None:
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--keep", action="store_true", help="leave the stack running at the end (debugging)")
    args = parser.parse_args(argv)
    if shutil.which("docker") is None:
        print(
            "compose-check: no docker command (bash ../shared/docker-local/setup.sh sets one up)",
            file=sys.stderr,
        )
        return 1
    project = f"tokenfleet-check-{secrets.token_hex(3)}"
    scratch = Path(tempfile.mkdtemp(prefix=f"{project}-"))
    scratch.chmod(0o755)
    user, password = "check", secrets.token_hex(8)
    stack = Stack(
        project=project,
        env_file=scratch / "check.env",
        image=f"{project}:local",
        flower_port=free_port(),
        metrics_port=free_port(),
        flower_auth=(user, password),
    )
    write_env_file(
        stack.env_file,
        {
            "TOKENFLEET_IMAGE": stack.image,
            "FLOWER_BASIC_AUTH": f"{user}:{password}",
            "FLOWER_PORT": str(stack.flower_port),
            "METRICS_PORT": str(stack.metrics_port),
        },
    )
    times: dict[str, float] = {}
    started = time.monotonic()
    log(
        f"project {project}, Flower on 127.0.0.1:{stack.flower_port}, "
        f"metrics on 127.0.0.1:{stack.metrics_port}"
    )
    failed: str | None = None
    try:
        run(stack, times, scratch)
    except (CheckFailed, subprocess.TimeoutExpired, httpx.HTTPError, KeyError, ValueError) as e:
        failed = f"{type(e).__name__}: {e}"
        log(f"FAILED: {failed}")
        print(stack.compose("logs", "--no-color", "--tail", "40", check=False), flush=True)
    finally:
        if args.keep:
            log(f"left running: docker compose -p {project} --env-file {stack.env_file} ...")
        else:
            stack.compose("down", "-v", "--remove-orphans", check=False)
            subprocess.run(["docker", "image", "rm", "-f", stack.image], capture_output=True, check=False)
            shutil.rmtree(scratch, ignore_errors=True)
    for name, seconds in times.items():
        log(f"time: {name}: {seconds:.1f} s")
    log(f"{'FAILED' if failed else 'passed'} in {time.monotonic() - started:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
