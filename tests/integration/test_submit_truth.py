"""submit's exit code tells the truth: 0 only when the ledger says every dataset is settled (every source
sample exported, failed with a reason, rejected, or dropped by a limit or a revoke), and any other end is
a non-zero exit that says what is left. Faults are injected into real worker processes near the end of a
dataset, where a lease nobody reclaimed used to pass for the end."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from budget import Ledger
from tests.support.files import read_jsonl, unique, write_config
from tests.support.fleet import (
    BackgroundSubmit,
    PrivateFleet,
    Sim,
    export,
    submit_process,
    token_rows,
    wait_until,
)
from tokenfleet.cli import EXIT_UNSETTLED, main

pytestmark = pytest.mark.integration


def part_records(out: Path, name: str) -> list[dict[str, Any]]:
    return [r for p in sorted((out / name).glob("part-*.jsonl")) for r in read_jsonl(p)]


def assert_all_exported_once(ledger: Ledger, name: str, tmp_path: Path, n: int) -> list[dict[str, Any]]:
    snap = ledger.snapshot(name)
    records = export(ledger, name, tmp_path)
    assert snap.settled and (snap.pending, snap.queued, snap.inflight) == (0, 0, 0)
    assert snap.samples == len(records) == n
    assert len({r["id"] for r in records}) == n  # duplicates in the export: 0
    assert snap.tokens == sum(r["completion_tokens"] for r in records)  # ledger equals export
    return records


def status_settled(url: str, name: str, capsys: pytest.CaptureFixture[str]) -> bool:
    capsys.readouterr()
    assert main(["status", "--json", "--redis-url", url, name]) == 0
    body = orjson.loads(capsys.readouterr().out)
    return bool(body["datasets"][0]["settled"])


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_worker_killed_or_frozen_near_the_end_of_a_dataset_loses_no_sample_and_submit_exits_0(
    fault: str,
    private_fleet: Callable[..., PrivateFleet],
    sim_factory: Callable[..., Sim],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fleet = private_fleet()
    victim = fleet.start_worker("victim")
    fleet.start_worker("survivor")
    sim = sim_factory(step_time_s=0.01, output_len_mean=60.0)
    name = unique(f"near_end_{fault.lower()}")
    n = 160
    config = write_config(
        tmp_path, redis_url=fleet.url, servers=[sim.url], datasets=[{"name": name, "rows": token_rows(n)}]
    )
    ledger = fleet.ledger()
    run = BackgroundSubmit(config, "--window", "16")
    wait_until(lambda: name in ledger.datasets() and ledger.snapshot(name).samples >= n - 40)
    victim.send_signal(getattr(signal, fault))  # the workers' leases are 3 s (TOKENFLEET_LEASE_S)

    assert run.wait(timeout_s=150) == 0
    assert ledger.snapshot(name).reclaimed > 0  # the fault hit generations in flight
    records = assert_all_exported_once(ledger, name, tmp_path, n)
    assert status_settled(fleet.url, name, capsys)
    if fault == "SIGSTOP":  # thawed, the frozen worker's late answers change nothing
        victim.send_signal(signal.SIGCONT)
        time.sleep(3.0)
        assert ledger.snapshot(name).samples == n
        assert export(ledger, name, tmp_path / "again") == records
    print(f"{fault}: wasted tokens {ledger.snapshot(name).wasted_tokens}")


def test_the_fault_matrix_scenario_end_to_end_exports_every_sample_once(
    private_fleet: Callable[..., PrivateFleet],
    sim_factory: Callable[..., Sim],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Two datasets of 400; 2 s into generation every worker is SIGKILLed and restarted; 4 s in submit is
    SIGKILLed; submit is run again."""
    fleet = private_fleet()
    for w in ("a", "b"):
        fleet.start_worker(w)
    # 16 at once on the server (workers hold twice that): the run lasts long enough for the faults
    sim = sim_factory(step_time_s=0.005, output_len_mean=40.0, max_running_requests=16)
    names = [unique("matrix_a"), unique("matrix_b")]
    config = write_config(
        tmp_path,
        redis_url=fleet.url,
        servers=[sim.url],
        datasets=[{"name": nm, "rows": token_rows(400, seed=i)} for i, nm in enumerate(names)],
    )
    ledger = fleet.ledger()
    first: subprocess.Popen[bytes] = submit_process(config, "--window", "64")

    def generating() -> bool:  # counted from here, not from submit's start (its imports take seconds)
        known = set(ledger.datasets())
        return all(nm in known for nm in names) and sum(ledger.snapshot(nm).samples for nm in names) >= 16

    wait_until(generating, what="both datasets generating")
    started = time.monotonic()
    time.sleep(2.0)
    for w in ("a", "b"):
        fleet.workers[w].send_signal(signal.SIGKILL)
        fleet.workers[w].wait()
    for w in ("a2", "b2"):
        fleet.start_worker(w)
    time.sleep(max(0.0, started + 4.0 - time.monotonic()))
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert any(ledger.snapshot(nm).samples < 400 for nm in names)  # the faults struck mid-run

    assert BackgroundSubmit(config, "--window", "64").wait(timeout_s=240) == 0
    for nm in names:
        assert_all_exported_once(ledger, nm, tmp_path, 400)
        assert status_settled(fleet.url, nm, capsys)
    print("\nmatrix: wasted tokens " + ", ".join(str(ledger.snapshot(nm).wasted_tokens) for nm in names))


def test_with_no_worker_online_submit_gives_up_with_exit_3_and_says_what_is_left(
    private_fleet: Callable[..., PrivateFleet],
    sim: Sim,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fleet = private_fleet()  # no worker at all
    name = unique("nobody")
    config = write_config(
        tmp_path, redis_url=fleet.url, servers=[sim.url], datasets=[{"name": name, "rows": token_rows(30)}]
    )

    code = main(["submit", str(config), "--no-server-check", "--give-up-after", "1.5"])

    out = capsys.readouterr()
    assert code == EXIT_UNSETTLED
    assert "no progress and no worker online" in out.err
    assert f"{name}: 30 of 30 source samples not done, 0 pending, 0 in flight, 30 queued" in out.err
    titles = [line.strip() for line in out.out.splitlines()]
    assert "not settled" in titles and "settled" not in titles
    assert sim.stats()["requests"] == 0
