"""``status``: the figures (rates, ETA, projections) against a run with known rates, and the workers."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from budget import Ledger
from tests.support.files import unique, write_config
from tests.support.fleet import BackgroundSubmit, Sim, token_rows, wait_until
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

    assert run.wait() == 0
    ended = time.monotonic()
    final = fleet_ledger.snapshot(name)

    assert measured > 500  # the run was really going
    assert figures["tokens_per_s"] == pytest.approx(measured, rel=0.3)
    assert figures["samples_per_s"] == pytest.approx(figures["tokens_per_s"] / 101, rel=0.15)
    assert figures["eta_s"] == pytest.approx(
        figures["eta_budget_s"]
    )  # the budget comes before the source ends
    expected_eta = (budget - figures["tokens"] - figures["live_tokens"]) / figures["tokens_per_s"]
    assert figures["eta_budget_s"] == pytest.approx(expected_eta, rel=0.01)
    assert ended == pytest.approx(predicted_end, abs=max(2.0, 0.35 * figures["eta_s"]))
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
        text=True,
    )
    time.sleep(2.0)
    proc.send_signal(subprocess.signal.SIGINT)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 130
    assert "Traceback" not in err
    assert "dataset" in out or "no datasets" in out
