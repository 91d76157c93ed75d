"""A worker that cannot write its output: a full disk stops the dataset's generations at once, shows why,
and after space returns the work goes on with every record whole and counted once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from budget import Ledger
from tests.support.disks import every_line_is_a_whole_record, fill, mounted_tmpfs
from tests.support.files import unique, write_config
from tests.support.fleet import BackgroundSubmit, Sim, export, text_rows, wait_until
from tokenfleet.cli import main

pytestmark = pytest.mark.integration

#: A small disk: the records of the test fit, with room to spare, until the filler takes the rest.
DISK_BYTES = 4 * 1024 * 1024
#: Generations in flight fleet-wide in these tests (2 worker processes x 8 threads): the most a full disk
#: can cost before every worker has stopped taking the dataset's work.
FLEET_SLOTS = 16


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "disk", DISK_BYTES) as disk:
        yield disk


def test_a_full_disk_stops_generation_shows_why_and_resumes_with_whole_records(
    workers: Any,
    fleet_redis_url: str,
    fleet_ledger: Ledger,
    sim_factory: Any,
    small_disk: Path,
    tmp_path: Path,
) -> None:
    sim: Sim = sim_factory(step_time_s=0.005, output_len_mean=60.0)
    name = unique("fulldisk")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": text_rows(240)}],
        sampling={"max_new_tokens": 200},
    )
    config.write_text(config.read_text().replace('output_dir = "out"', f'output_dir = "{small_disk}"'))
    submit = BackgroundSubmit(config)
    wait_until(lambda: name in fleet_ledger.datasets(), what="the dataset registered")
    wait_until(lambda: fleet_ledger.snapshot(name).samples >= 30, what="the first records")

    filler = fill(small_disk)
    wait_until(
        lambda: bool(fleet_ledger.snapshot(name).output_error), what="the output problem in the ledger"
    )
    problem = fleet_ledger.snapshot(name).output_error
    assert "No space left on device" in problem and str(small_disk) in problem

    # Every worker stops taking the dataset's work: what runs ends, nothing new reaches the server.
    time.sleep(2.0)
    before = sim.stats()["requests"]
    time.sleep(3.0)
    started = sim.stats()["requests"] - before
    assert started <= FLEET_SLOTS, f"{started} generations started on a full disk"
    stalled = fleet_ledger.snapshot(name)
    assert stalled.state == "active" and not stalled.settled and stalled.failed == 0

    filler.unlink()
    assert submit.wait(120) == 0
    snap = fleet_ledger.snapshot(name)
    assert snap.settled and snap.samples == 240 and snap.failed == 0
    # Another worker may have written this one's held records: it lifts its block at its next look (10 s).
    wait_until(lambda: not fleet_ledger.snapshot(name).output_error, what="the output problem cleared")

    on_disk = every_line_is_a_whole_record(small_disk / name)
    records = export(fleet_ledger, name, tmp_path)
    assert sorted(r["id"] for r in records) == sorted(f"prompt-{i}" for i in range(240))
    assert snap.tokens == sum(r["completion_tokens"] for r in records)
    counted = {r["id"]: r["attempt"] for r in records}
    assert all(r["id"] in counted for r in on_disk)
    assert not list((small_disk / name).glob(".probe-*")), "a writability probe was left behind"


def test_a_disk_that_fills_mid_run_costs_only_the_generations_in_flight_which_are_held_and_written_once(
    workers: Any,
    fleet_redis_url: str,
    fleet_ledger: Ledger,
    sim_factory: Any,
    small_disk: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Generations long enough (about 0.6 s) that some are always in flight when the disk fills.
    sim: Sim = sim_factory(step_time_s=0.01, output_len_mean=60.0)
    name = unique("held")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": text_rows(240)}],
        sampling={"max_new_tokens": 200},
    )
    config.write_text(config.read_text().replace('output_dir = "out"', f'output_dir = "{small_disk}"'))
    submit = BackgroundSubmit(config)
    wait_until(lambda: name in fleet_ledger.datasets(), what="the dataset registered")
    wait_until(lambda: fleet_ledger.snapshot(name).samples >= 30, what="the first records")

    at_fill = fleet_ledger.snapshot(name)
    before = sim.stats()
    filler = fill(small_disk)  # full: not a byte left
    wait_until(lambda: fleet_ledger.snapshot(name).held > 0, what="a record held in the ledger")
    time.sleep(5.0)  # the disk stays full: nothing new may start
    full = fleet_ledger.snapshot(name)
    during = sim.stats()
    started_while_full = during["requests"] - before["requests"]
    # At most the generations already admitted when the disk filled reach the server: none admitted after.
    assert started_while_full <= at_fill.inflight, (started_while_full, at_fill.inflight)
    assert full.held > 0 and full.inflight >= full.held and not full.settled and submit.code is None
    problem = full.output_error
    assert str(small_disk) in problem and "held in the ledger" in problem
    assert "No space left on device" in problem or "not enough room" in problem
    capsys.readouterr()
    assert main(["status", "--redis-url", fleet_redis_url]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "output not writable" in shown and "held in the ledger" in shown

    filler.unlink()  # the operator frees space
    assert submit.wait(120) == 0
    snap = fleet_ledger.snapshot(name)
    assert snap.settled and snap.samples == 240 and snap.failed == 0
    assert snap.held == 0 and snap.held_bytes == 0
    # A worker whose last task met the full disk lifts its block at its next look (every 10 s).
    wait_until(lambda: not fleet_ledger.snapshot(name).output_error, what="the output problem cleared")

    after = sim.stats()
    # Not one generation again: 240 samples, 240 requests; every token generated is in the export.
    assert after["requests"] == 240, after["requests"]
    on_disk = every_line_is_a_whole_record(small_disk / name)
    records = export(fleet_ledger, name, tmp_path)
    assert sorted(r["id"] for r in records) == sorted(f"prompt-{i}" for i in range(240))
    assert snap.tokens == sum(r["completion_tokens"] for r in records) == after["generated_tokens"]
    counted = {r["id"]: r["attempt"] for r in records}
    assert sorted(r["id"] for r in on_disk if counted[r["id"]] == r["attempt"]) == sorted(counted)
    print(
        f"\nfull for 5 s: {at_fill.inflight} in flight at the fill, {started_while_full} started after it "
        f"({during['generated_tokens'] - before['generated_tokens']:,} tokens generated while full), "
        f"{full.held} held ({full.held_bytes:,} bytes), {after['requests']} requests for 240 samples"
    )
