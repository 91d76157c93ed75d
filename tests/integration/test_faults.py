"""Faults against real processes: after each, every good sample is exported exactly once, ledger tokens
equal the export's tokens, and submit exits 0 once settled."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from budget import DatasetLimits, Ledger
from producer.source import Sample
from tests.support.files import read_jsonl, unique, write_config
from tests.support.fleet import (
    BackgroundSubmit,
    PrivateFleet,
    Sim,
    export,
    submit_process,
    text_rows,
    token_rows,
    wait_until,
)
from tokenfleet.cli import main
from tokenfleet.config import load_config
from tokenfleet.export import export_dataset
from tokenfleet.publish import TaskPublisher
from tokenfleet.submit import warn_on_disagreement
from workers.app import make_app
from workers.rids import dataset_tag

pytestmark = pytest.mark.integration

RETRY_FAST = "\n[retry]\nmax_attempts = 4\nbackoff_base_s = 0.05\nbackoff_cap_s = 0.5\n"


def assert_exact(ledger: Ledger, name: str, tmp_path: Path, n: int) -> list[dict[str, Any]]:
    """Every sample exported once; the ledger's tokens are the export's."""
    snap = ledger.snapshot(name)
    records = export(ledger, name, tmp_path)
    assert snap.samples == len(records) == n
    assert len({r["id"] for r in records}) == n
    assert snap.tokens == sum(r["completion_tokens"] for r in records)
    assert snap.settled and snap.inflight == 0 and snap.queued == 0
    return records


def test_a_worker_killed_mid_generation_has_its_samples_generated_again_and_committed_once(
    private_fleet: Callable[..., PrivateFleet], sim_factory: Callable[..., Sim], tmp_path: Path
) -> None:
    fleet = private_fleet()
    victim = fleet.start_worker("victim")
    fleet.start_worker("survivor")
    # 8 at once on the server: each worker process holds twice that, so both have work in flight
    sim = sim_factory(step_time_s=0.005, output_len_mean=60.0, max_running_requests=8)
    name = unique("killed_worker")
    config = write_config(
        tmp_path, redis_url=fleet.url, servers=[sim.url], datasets=[{"name": name, "rows": token_rows(120)}]
    )
    ledger = fleet.ledger()
    run = BackgroundSubmit(config, "--window", "32")
    wait_until(
        lambda: any(w["name"].startswith("victim@") and w.get("inflight", 0) > 0 for w in ledger.workers()),
        what="the victim to hold generations in flight",
    )

    victim.send_signal(signal.SIGKILL)
    victim.wait()
    fleet.start_worker("victim-restarted")

    assert run.wait(timeout_s=90) == 0
    assert_exact(ledger, name, tmp_path, 120)
    assert ledger.snapshot(name).reclaimed > 0  # the killed worker's leases expired and were taken back


def test_a_killed_submit_rerun_settles_with_no_lease_or_queue_left_behind(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim_factory: Callable[..., Sim], tmp_path: Path
) -> None:
    sim = sim_factory(step_time_s=0.01, output_len_mean=40.0)
    name = unique("killed_submit")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": text_rows(100)}],
    )
    for _ in range(2):  # killed twice at different points
        proc = submit_process(config, "--window", "8")
        time.sleep(1.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    assert main(["submit", str(config), "--no-server-check"]) == 0
    assert_exact(fleet_ledger, name, tmp_path, 100)
    keys = fleet_ledger.keys_of(name)
    assert fleet_ledger.client.zcard(keys.lease_zset) == 0
    assert fleet_ledger.client.hlen(keys.live_hash) == 0


def test_the_job_continues_across_a_redis_restart_with_aof(
    private_fleet: Callable[..., PrivateFleet], sim_factory: Callable[..., Sim], tmp_path: Path
) -> None:
    fleet = private_fleet(redis_args=("--appendonly", "yes", "--appendfsync", "everysec", "--save", ""))
    fleet.start_worker("w1")
    fleet.start_worker("w2")
    sim = sim_factory(step_time_s=0.01, output_len_mean=40.0)
    name = unique("redis_restart")
    config = write_config(
        tmp_path, redis_url=fleet.url, servers=[sim.url], datasets=[{"name": name, "rows": token_rows(150)}]
    )
    ledger = fleet.ledger()
    run = BackgroundSubmit(config, "--window", "32")
    wait_until(lambda: name in ledger.datasets() and ledger.snapshot(name).samples >= 20)

    fleet.restart_redis(down_s=2.0)

    assert run.wait(timeout_s=120) == 0
    assert_exact(fleet.ledger(), name, tmp_path, 150)


def test_a_lost_ledger_is_detected_at_submit_and_rebuilt_from_the_outputs_by_reconcile(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim: Sim, tmp_path: Path
) -> None:
    name = unique("lost_ledger")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": text_rows(40)}],
    )
    assert main(["submit", str(config), "--no-server-check"]) == 0
    before = fleet_ledger.snapshot(name)
    fleet_ledger.forget(name)  # the ledger is lost; the output files remain

    seen = Console(record=True, width=300)
    warn_on_disagreement(load_config(config), fleet_ledger, seen)
    warning = seen.export_text()
    assert "the ledger counts no sample" in warning and "tokenfleet reconcile" in warning

    assert main(["reconcile", "--config", str(config)]) == 0
    after = fleet_ledger.snapshot(name)
    assert (after.samples, after.tokens) == (before.samples, before.tokens) == (40, before.tokens)
    requests = sim.stats()["requests"]
    assert main(["submit", str(config), "--no-server-check"]) == 0
    assert sim.stats()["requests"] == requests  # nothing generated again
    assert_exact(fleet_ledger, name, tmp_path, 40)


def test_a_torn_last_line_is_skipped_by_export_and_reconcile(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim: Sim, tmp_path: Path
) -> None:
    name = unique("torn")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": text_rows(20)}],
    )
    assert main(["submit", str(config), "--no-server-check"]) == 0
    tokens = fleet_ledger.snapshot(name).tokens
    part = next((tmp_path / "out" / name).glob("part-*.jsonl"))
    with part.open("ab") as f:
        f.write(
            b'{"id": "prompt-3", "dataset": "' + name.encode() + b'", "output_ids": [1, 2'
        )  # a crash mid-write

    report = export_dataset(fleet_ledger, name, tmp_path / "export.jsonl")
    assert (report.records, report.tokens, report.torn_lines) == (20, tokens, 1)
    assert main(["reconcile", name, "--redis-url", fleet_redis_url]) == 0
    assert (fleet_ledger.snapshot(name).samples, fleet_ledger.snapshot(name).tokens) == (20, tokens)


def test_a_task_delivered_twice_at_once_runs_one_generation(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim_factory: Callable[..., Sim], tmp_path: Path
) -> None:
    sim = sim_factory(step_time_s=0.01, fixed_output_len=100)
    name = unique("twice")
    spec = {"servers": [sim.url], "sampling": {"max_new_tokens": 200}, "output_dir": str(tmp_path / "out")}
    fleet_ledger.register(name, DatasetLimits(), spec)
    sample = Sample("only", 1, [5, 6, 7], None, {})
    assert fleet_ledger.enqueue(name, ["only"], 10) == [1]
    publish = TaskPublisher(make_app(fleet_redis_url))
    publish(name, [sample])
    publish(name, [sample])  # the visibility timeout handing the same message to a second worker

    wait_until(lambda: fleet_ledger.snapshot(name).samples == 1 and fleet_ledger.snapshot(name).inflight == 0)
    time.sleep(0.5)
    assert sim.stats()["requests"] == 1
    records = [r for p in (tmp_path / "out" / name).glob("part-*.jsonl") for r in read_jsonl(p)]
    assert len(records) == 1 and fleet_ledger.snapshot(name).tokens == records[0]["completion_tokens"]


def test_a_server_restarting_mid_run_loses_nothing(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim_factory: Callable[..., Sim], tmp_path: Path
) -> None:
    from tokenfleet.processes import free_port

    port = free_port()
    sim = sim_factory(port=port, step_time_s=0.01, output_len_mean=40.0)
    name = unique("server_restart")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": token_rows(120)}],
    )
    config.write_text(config.read_text() + RETRY_FAST)
    run = BackgroundSubmit(config, "--window", "32")
    wait_until(lambda: name in fleet_ledger.datasets() and fleet_ledger.snapshot(name).samples >= 10)

    sim.server.stop()
    time.sleep(3.0)
    sim_factory(port=port, step_time_s=0.01, output_len_mean=40.0)

    assert run.wait(timeout_s=120) == 0
    assert fleet_ledger.snapshot(name).failed == 0
    assert_exact(fleet_ledger, name, tmp_path, 120)


def test_a_server_slower_than_the_timeout_is_retried_and_its_timed_out_tokens_never_counted(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim_factory: Callable[..., Sim], tmp_path: Path
) -> None:
    sim = sim_factory(step_time_s=0.05, fixed_output_len=60)  # 3 s per answer at first
    name = unique("slow")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": token_rows(20)}],
    )
    config.write_text(config.read_text().replace("timeout_s = 60", "timeout_s = 1") + RETRY_FAST)
    run = BackgroundSubmit(config)
    wait_until(lambda: sim.stats()["requests"] >= 24)  # first attempts timed out and were retried
    sim.configure(step_time_s=0.002)

    assert run.wait(timeout_s=120) == 0
    records = assert_exact(fleet_ledger, name, tmp_path, 20)
    assert all(r["completion_tokens"] == 61 for r in records)  # 60 tokens and EOS: whole answers only
    assert sim.stats()["generated_tokens"] > fleet_ledger.snapshot(name).tokens  # timed-out work was wasted


def test_a_server_that_keeps_failing_fails_each_sample_after_three_give_ups_without_spinning(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim_factory: Callable[..., Sim], tmp_path: Path
) -> None:
    sim = sim_factory(error_rate=1.0)
    name = unique("always_503")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": token_rows(5)}],
    )
    config.write_text(
        # min_span_s: a task's last attempt waits until this long after its first (default 10 s)
        config.read_text()
        + "\n[retry]\nmax_attempts = 2\nbackoff_base_s = 0.05\nbackoff_cap_s = 0.1\nmin_span_s = 1.0\n"
    )

    assert main(["submit", str(config), "--no-server-check"]) == 0

    snap = fleet_ledger.snapshot(name)
    assert (snap.failed, snap.samples, snap.pending) == (5, 0, 0)
    assert all("gave up after 2 attempts" in r and "503" in r for r in fleet_ledger.failures(name).values())
    # Bounded: 2 attempts per task, 3 tasks per sample. (The server's probes, one real one-token
    # generation per probe interval while it is down, are not the dataset's requests: their rids differ.)
    dataset_requests = sim.stats()["requests_by_prefix"].get(dataset_tag(name), 0)
    assert dataset_requests == 5 * 2 * 3


def test_workers_refuse_pickled_messages(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim: Sim, tmp_path: Path
) -> None:
    name = unique("pickled")
    spec = {"servers": [sim.url], "sampling": {"max_new_tokens": 16}, "output_dir": str(tmp_path / "out")}
    fleet_ledger.register(name, DatasetLimits(), spec)
    assert fleet_ledger.enqueue(name, ["p1"], 10) == [1]
    sender = make_app(fleet_redis_url)
    sender.conf.task_serializer = "pickle"
    sender.conf.accept_content = ["pickle", "json"]
    sender.send_task(
        "tokenfleet.generate",
        kwargs={"dataset": name, "sample_id": "p1", "sample": {"input_ids": [1, 2, 3]}},
        serializer="pickle",
    )

    wait_until(lambda: fleet_ledger.client.llen("tokenfleet") == 0, what="the message to be taken")
    time.sleep(1.0)
    assert sim.stats()["requests"] == 0
    assert fleet_ledger.snapshot(name).samples == 0


def test_credentials_never_appear_in_logs_or_status(
    private_fleet: Callable[..., PrivateFleet],
    sim: Sim,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    secret = "s3cret-Pa55"
    fleet = private_fleet(password=secret)
    url = fleet.url
    fleet.start_worker("authed", loglevel="INFO")
    name = unique("authed")
    config = write_config(
        tmp_path, redis_url=url, servers=[sim.url], datasets=[{"name": name, "rows": text_rows(10)}]
    )

    assert main(["submit", str(config)]) == 0
    assert main(["status", "--redis-url", url]) == 0
    assert main(["status", "--json", "--redis-url", url]) == 0
    assert main(["status", "--redis-url", url.replace(secret, "wrong")]) == 2

    out = capsys.readouterr()
    logs = "".join(p.read_text(errors="replace") for p in fleet.folder.glob("*.log"))
    assert name in out.out and "authed@" in logs  # the worker banner and logs were captured
    for text in (out.out, out.err, logs):
        assert secret not in text
    assert Ledger.from_url(url).snapshot(name).samples == 10
