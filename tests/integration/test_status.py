"""``status``: the figures (rates, ETA, projections) against a run with known rates, the workers (their
in-flight figures once a run settled), and the view in a real terminal (tmux) at 80, 120 and 200
columns, once and with ``--watch``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from budget import DatasetLimits, Ledger
from tests.support.env import IN_CI
from tests.support.files import unique, write_config
from tests.support.fleet import BackgroundSubmit, PrivateFleet, Sim, token_rows, wait_until
from tests.support.ledger import SPEC
from tests.support.status import Terminal, commit_many, issue_datasets, shows
from tokenfleet.cli import main
from workers.version import full_version

pytestmark = pytest.mark.integration


def status_json(redis_url: str, capsys: pytest.CaptureFixture[str], *names: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["status", "--json", "--redis-url", redis_url, *names]) == 0
    data: dict[str, Any] = orjson.loads(capsys.readouterr().out)
    return data


def test_status_rates_and_eta_match_a_run_with_known_rates(
    workers: Any,
    fleet_redis_url: str,
    fleet_ledger: Ledger,
    sim_factory: Callable[..., Sim],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Every answer is 100 tokens + EOS; 16 in flight (the server's batch size, the fleet's cap on it) at
    # 5 ms per decode step: the simulator can give 16 x 200 = 3,200 tokens/s. The fleet gets what it can
    # of that on 2 cores.
    sim = sim_factory(step_time_s=0.005, fixed_output_len=100, max_running_requests=16)
    name = unique("known_rates")
    budget = 40_000
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": token_rows(1000, seed=21), "token_budget": budget}],
        # Each generation reserves max_new_tokens of the budget, so its last ~16 x max_new_tokens run at
        # a lower concurrency (docs/budgets.md): 128 (answers are 101) keeps that tail short of the ETA's
        # tolerance; with 256 the end came 5 s after an ETA of 7 s.
        sampling={"max_new_tokens": 128},
    )
    run = BackgroundSubmit(config, "--window", "64")
    wait_until(lambda: name in fleet_ledger.datasets() and fleet_ledger.snapshot(name).samples >= 40)

    # The rate over a few seconds, measured from outside the ledger: the simulator's own counter.
    t0, g0 = time.monotonic(), sim.stats()["generated_tokens"]
    time.sleep(4.0)
    t1, g1 = time.monotonic(), sim.stats()["generated_tokens"]
    measured = (g1 - g0) / (t1 - t0)
    figures = next(d for d in status_json(fleet_redis_url, capsys, name)["datasets"] if d["name"] == name)
    predicted_end = time.monotonic() + figures["eta_s"]
    generated_at_status = sim.stats()["generated_tokens"]

    assert run.wait() == 0
    ended = time.monotonic()
    final = fleet_ledger.snapshot(name)
    generated_after = sim.stats()["generated_tokens"] - generated_at_status
    left = budget - figures["tokens"] - figures["live_tokens"]
    seen = (
        f"status: {figures['tokens_per_s']:.0f} tok/s (simulator {measured:.0f}), {left} tokens left "
        f"(simulator: {generated_after} generated after), ETA {figures['eta_s']:.1f} s, "
        f"ended {ended - predicted_end:+.1f} s from it"
    )

    assert measured > 500  # the run was really going
    assert figures["tokens_per_s"] == pytest.approx(measured, rel=0.3), seen
    assert figures["samples_per_s"] == pytest.approx(figures["tokens_per_s"] / 101, rel=0.15)
    assert figures["eta_s"] == pytest.approx(
        figures["eta_budget_s"]
    )  # the budget comes before the source ends
    assert figures["eta_budget_s"] == pytest.approx(left / figures["tokens_per_s"], rel=0.01)
    # What the ETA divides is right: the tokens it says are left are the ones the server generated after:
    # never more (truncate: nothing past the budget), a little fewer (5% here) where the generations in
    # flight had generated more than they had reported yet.
    assert 0.85 * left <= generated_after <= 1.01 * left, seen
    # ... and the run ended about when it said. Loosely: the rate it divides by is the past's, and a shared
    # machine's speed changes within seconds (the tail, where reservations hold part of the budget, runs
    # below full concurrency too).
    assert ended == pytest.approx(predicted_end, abs=max(3.0, 0.6 * figures["eta_s"])), seen
    # truncate: every generation is capped at its reservation of the budget, so nothing is expected past it
    assert figures["projected_overshoot_tokens"] == 0
    assert final.state == "exhausted"
    body = status_json(fleet_redis_url, capsys, name)
    after = next(d for d in body["datasets"] if d["name"] == name)
    server = next(s for s in body["servers"] if s["url"] == sim.url)
    assert server["up"] and server["started"] >= final.samples and server["inflight"] == 0
    assert after["projected_overshoot_tokens"] == final.tokens - budget
    assert after["eta_s"] == 0


def test_status_lists_the_workers_online_and_flags_one_running_other_code(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    wait_until(lambda: len(fleet_ledger.workers()) >= 2, what="worker heartbeats")
    fleet_ledger.heartbeat("old-copy@gpu-box", {"version": "0.1.0+code.0ld0ld0ld0", "inflight": 3})

    data = status_json(fleet_redis_url, capsys)
    by_name = {w["name"]: w for w in data["workers"]}
    assert data["version"] == full_version()
    assert by_name["old-copy@gpu-box"]["stale"] is True
    ours = [w for n, w in by_name.items() if n != "old-copy@gpu-box"]
    assert len(ours) >= 2 and all(w["version"] == full_version() and not w["stale"] for w in ours)

    assert main(["status", "--redis-url", fleet_redis_url]) == 0
    text = capsys.readouterr().out
    assert "old-copy@gpu-box" in text and f"submitter runs {full_version()}" in text
    fleet_ledger.heartbeat("old-copy@gpu-box", None)


def _sigint_as_in_a_terminal() -> None:  # runs in the child, before exec
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_status_watch_redraws_until_interrupted(fleet_redis_url: str, fleet_ledger: Ledger) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenfleet.cli",
            "status",
            "--watch",
            "--interval",
            "0.2",
            "--redis-url",
            fleet_redis_url,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        # Ctrl-C as a terminal delivers it: a test run started in the background (`.ci/run &`) passes
        # SIGINT on ignored, and Python then installs no KeyboardInterrupt handler (the stacks of three
        # fresh-clone runs: still sleeping in the watch loop 10 s after the signal)
        preexec_fn=_sigint_as_in_a_terminal,
    )
    shown = bytearray()
    redrawn = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        while chunk := os.read(proc.stdout.fileno(), 65536):
            shown.extend(chunk)
            if shown.count(b"dataset") >= 2:  # two views: the header, or "no datasets in the ledger"
                redrawn.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    # interrupted once it has drawn twice (a slow machine's imports alone take seconds)
    assert redrawn.wait(30), f"status --watch did not draw twice into a pipe in 30 s: {bytes(shown)!r}"
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        # still running 10 s after Ctrl-C: its threads' stacks (PYTHONFAULTHANDLER dumps them on SIGABRT)
        # and what it wrote say where it was
        os.kill(proc.pid, signal.SIGABRT)
        proc.wait(timeout=10)
        assert proc.stderr is not None
        err = proc.stderr.read().decode(errors="replace")
        tail = bytes(shown[-1500:])
        raise AssertionError(
            f"status --watch still ran 10 s after Ctrl-C; stderr ({len(err)} bytes): {err[-3000:]!r}; "
            f"stdout ({len(shown)} bytes), its end: {tail!r}"
        ) from None
    reader.join(timeout=10)
    assert proc.stderr is not None
    err = proc.stderr.read().decode()
    assert proc.returncode == 130
    assert "Traceback" not in err
    assert err.strip() == "interrupted"  # it only read: no word of resuming
    assert shown.count(b"dataset") >= 2


def test_once_a_run_settles_no_worker_reports_generations_in_flight(
    private_fleet: Callable[..., PrivateFleet],
    sim_factory: Callable[..., Sim],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The issue: after the job settled, the workers table showed a worker with 3 in flight while every
    # dataset showed 0 (the figure was the last 5-second heartbeat's). This worker's timer beat never
    # comes during the test: only a beat sent when its in-flight count changes can show the count going
    # up during the run, and back to 0 once it settled.
    fleet = private_fleet()
    fleet.start_worker("beat", concurrency=8, env={"TOKENFLEET_HEARTBEAT_S": "3600"})
    ledger = fleet.ledger()
    sim = sim_factory(step_time_s=0.005, fixed_output_len=60)
    config = write_config(
        tmp_path,
        redis_url=fleet.url,
        servers=[sim.url],
        datasets=[{"name": "B1_sharegpt", "rows": token_rows(300, seed=5), "token_budget": 6000}],
    )
    run = BackgroundSubmit(config)
    wait_until(
        lambda: any(int(w.get("inflight") or 0) > 0 for w in ledger.workers()),
        what="the worker reporting generations in flight",
    )
    assert run.wait() == 0
    assert ledger.snapshot("B1_sharegpt").settled

    wait_until(
        lambda: [w.get("inflight") for w in ledger.workers()] == [0],
        what="the worker reporting 0 in flight once the run settled",
    )
    body = status_json(fleet.url, capsys)
    assert [(w["name"].split("@")[0], w["inflight"]) for w in body["workers"]] == [("beat", 0)]
    assert [d["inflight"] for d in body["datasets"]] == [0]


def terminal(argv: list[str], width: int) -> Terminal:
    if shutil.which("tmux") is None:
        if IN_CI:
            raise AssertionError("tmux is not installed")
        pytest.skip("tmux is not installed")
    return Terminal([sys.executable, "-m", "tokenfleet.cli", *argv], width)


def assert_fits(screen: str, width: int) -> None:
    assert all(len(line) <= width for line in screen.splitlines()), screen
    assert "…" not in screen, screen


@pytest.mark.parametrize("width", (80, 120, 200))
def test_status_in_a_real_terminal_shows_every_name_and_figure_whole(
    ledger: Ledger, redis_url: str, width: int
) -> None:
    expected = issue_datasets(ledger)
    term = terminal(["status", "--redis-url", redis_url], width)
    try:
        wait_until(lambda: "[exit " in term.screen(), what="status to finish")
        screen = term.screen()
    finally:
        term.close()

    assert "[exit 0]" in screen, screen
    assert_fits(screen, width)
    for shown in expected:
        assert shows(screen, shown.name), f"{shown.name} not whole at {width} columns:\n{screen}"
        for figure in shown.figures:
            assert shows(screen, figure), f"{shown.name}: {figure!r} not whole at {width} columns:\n{screen}"
    assert "no worker online" in screen


def test_status_watch_redraws_in_place_in_a_real_terminal_until_ctrl_c(
    ledger: Ledger, redis_url: str
) -> None:
    issue_datasets(ledger)
    term = terminal(["status", "--watch", "--interval", "0.2", "--redis-url", redis_url], 120)
    try:
        wait_until(lambda: "B4_big" in term.screen(), what="the first view")
        ledger.register("B6_late", DatasetLimits(max_samples=40), SPEC)
        commit_many(ledger, "B6_late", "z", [77] * 40)
        wait_until(lambda: shows(term.screen(), "40 / 40 100%"), what="the new dataset in the view")
        screen = term.screen()
        term.keys("C-c")
        wait_until(lambda: "[exit " in term.screen(), what="status --watch to stop")
        after = term.screen()
    finally:
        term.close()

    assert screen.count("tokens / budget") == 1, screen  # one view, redrawn where it was
    assert_fits(screen, 120)
    assert shows(screen, "B6_late") and shows(screen, "3,080")
    assert "[exit 130]" in after and "Traceback" not in after, after
