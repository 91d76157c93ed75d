"""The fleet end to end: real worker processes, real Redis, the simulator over real HTTP."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from budget import Ledger
from tests.support.files import read_jsonl, unique, write_config
from tests.support.fleet import Sim, export, submit, submit_process, text_rows, token_rows

pytestmark = pytest.mark.integration

SETTLE_TIMEOUT_S = 60


def wait_settled_after_kill(
    ledger: Ledger, name: str, timeout_s: float = SETTLE_TIMEOUT_S, still_s: float = 2.0
) -> None:
    """After a producer was killed: nothing in flight, and nothing queued, or what is queued unchanged
    (with the counts) for ``still_s``. A kill between marking samples queued and publishing them leaves
    marks with no message, which only the next submit's first audit clears (producer/feeder.py): idle
    workers take a published message at once, so marks that stay put while nothing runs have none."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        s = ledger.snapshot(name)
        now = (s.samples, s.queued, s.inflight, s.pending)
        if now != last:
            last, since = now, time.monotonic()
        if s.inflight == 0 and (s.queued == 0 or time.monotonic() - since >= still_s):
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} still busy after {timeout_s} s: {ledger.snapshot(name)}")


def test_a_full_run_exports_every_sample_once_with_the_servers_exact_token_ids(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim: Sim, tmp_path: Path
) -> None:
    texts, tokens = unique("texts"), unique("tokens")
    token_samples = token_rows(30)
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": texts, "rows": text_rows(30)}, {"name": tokens, "rows": token_samples}],
        sampling={"max_new_tokens": 64, "temperature": 0.7},
    )

    assert submit(config) == 0

    for name in (texts, tokens):
        snap = fleet_ledger.snapshot(name)
        records = export(fleet_ledger, name, tmp_path)
        assert snap.settled and snap.state == "active"
        assert snap.samples == len(records) == 30
        assert len({r["id"] for r in records}) == 30
        assert snap.tokens == sum(r["completion_tokens"] for r in records)
        assert all(len(r["output_ids"]) == r["completion_tokens"] for r in records)
    by_prompt = {tuple(r["input_ids"]): r for r in read_jsonl(tmp_path / "exports" / f"{tokens}.jsonl")}
    for row in token_samples[:5]:  # what the workers kept is exactly what the server generates
        direct = sim.generate(row["input_ids"], {"max_new_tokens": 64, "temperature": 0.7})
        assert by_prompt[tuple(row["input_ids"])]["output_ids"] == direct["output_ids"]
    text_records = read_jsonl(tmp_path / "exports" / f"{texts}.jsonl")
    assert {r["meta"]["topic"] for r in text_records} == {0, 1, 2}
    assert all(r["dataset"] == texts and r["text"] for r in text_records)


def test_a_token_budget_stops_the_dataset_without_calling_the_server_for_queued_samples(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim: Sim, tmp_path: Path
) -> None:
    name = unique("budgeted")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": token_rows(300, seed=1), "token_budget": 2000}],
    )
    before = sim.stats()["requests"]

    assert submit(config, "--no-server-check", "--window", "64") == 0

    snap = fleet_ledger.snapshot(name)
    records = export(fleet_ledger, name, tmp_path)
    requests = sim.stats()["requests"] - before
    assert snap.state == "exhausted"
    assert snap.tokens >= 2000
    assert snap.tokens == sum(r["completion_tokens"] for r in records)
    # Only samples that were admitted reached the server: far fewer than the dataset holds. Near the
    # budget's end a generation may take several requests (one per grant: workers/continuation.py); each
    # record says how many.
    assert requests == sum(r["requests"] for r in records) + snap.failed
    assert len({r["id"] for r in records}) == snap.samples
    assert snap.samples < 120
    # Every source sample is accounted for: committed, dropped from the queue, or never fed.
    unfed = 300 - snap.samples - snap.failed - snap.pending
    assert unfed >= 0 and snap.pending + unfed == 300 - snap.samples


def test_max_samples_is_never_exceeded(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim: Sim, tmp_path: Path
) -> None:
    name = unique("capped")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": text_rows(120), "max_samples": 25}],
    )

    assert submit(config, "--no-server-check") == 0

    snap = fleet_ledger.snapshot(name)
    assert snap.state == "exhausted"
    assert snap.samples == 25
    assert len(export(fleet_ledger, name, tmp_path)) == 25


def test_resuming_after_an_interrupted_submit_generates_no_done_sample_again(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim_factory: Callable[..., Sim], tmp_path: Path
) -> None:
    # 8 at a time (0.3 s each): the run lasts several seconds, so the kill at 20 done lands mid-run
    sim = sim_factory(step_time_s=0.01, output_len_mean=30.0, max_running_requests=8)
    name = unique("resumed")
    n = 150
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": text_rows(n)}],
    )
    proc = submit_process(config, "--window", "16")
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while fleet_ledger.datasets().count(name) == 0 or fleet_ledger.snapshot(name).samples < 20:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    wait_settled_after_kill(fleet_ledger, name)
    done_before = fleet_ledger.snapshot(name).samples
    requests_before = sim.stats()["requests"]
    assert 20 <= done_before < n

    assert submit(config, "--no-server-check") == 0

    snap = fleet_ledger.snapshot(name)
    assert snap.samples == n
    # Each sample not done at the interruption was generated once more; none of the done ones.
    assert sim.stats()["requests"] - requests_before == n - done_before
    records = export(fleet_ledger, name, tmp_path)
    assert sorted(r["id"] for r in records) == sorted(f"prompt-{i}" for i in range(n))


def test_a_4xx_fails_the_sample_with_the_servers_message_and_is_never_retried(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim_factory: Callable[..., Sim], tmp_path: Path
) -> None:
    sim = sim_factory(context_length=64)
    name = unique("too_long")
    rows = [{"id": f"ok-{i}", "input_ids": [5] * 10} for i in range(5)]
    rows += [{"id": f"long-{i}", "input_ids": [7] * 100} for i in range(2)]
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": rows}],
        sampling={"max_new_tokens": 16},
    )

    assert submit(config, "--no-server-check") == 0

    snap = fleet_ledger.snapshot(name)
    failures = fleet_ledger.failures(name)
    assert snap.samples == 5 and snap.failed == 2
    assert set(failures) == {"long-0", "long-1"}
    assert all("longer than the model's context length" in reason for reason in failures.values())
    failed_lines = [f for p in (tmp_path / "out" / name).glob("failed-*.jsonl") for f in read_jsonl(p)]
    assert sorted(f["id"] for f in failed_lines) == ["long-0", "long-1"]
    assert sim.stats()["requests"] == 7  # one request per sample: the 400s were not retried


def test_5xx_dropped_streams_and_server_aborts_are_retried_and_counted_once(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim_factory: Callable[..., Sim], tmp_path: Path
) -> None:
    sim = sim_factory(error_rate=0.25, drop_rate=0.1, abort_rate=0.15, seed=3)
    name = unique("flaky")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": text_rows(40)}],
        top={},
    )
    config.write_text(
        config.read_text() + "\n[retry]\nmax_attempts = 15\nbackoff_base_s = 0.02\nbackoff_cap_s = 0.2\n"
    )

    assert submit(config, "--no-server-check") == 0

    snap = fleet_ledger.snapshot(name)
    records = export(fleet_ledger, name, tmp_path)
    stats = sim.stats()
    assert stats["errors_503"] > 0 and stats["dropped"] > 0 and stats["aborted"] > 0
    assert snap.failed == 0 and snap.samples == len(records) == 40
    assert snap.tokens == sum(r["completion_tokens"] for r in records)
    assert not any(r["finish_reason"]["type"] == "abort" for r in records)


def test_samples_grouped_several_to_a_task_are_each_generated_and_counted_once(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim: Sim, tmp_path: Path
) -> None:
    grouped, capped = unique("grouped"), unique("grouped_capped")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[
            {"name": grouped, "rows": token_rows(43, seed=4)},
            {"name": capped, "rows": token_rows(60, seed=6), "max_samples": 17},
        ],
        top={"samples_per_task": 4},
    )
    requests = sim.stats()["requests"]

    assert submit(config, "--no-server-check") == 0

    records = export(fleet_ledger, grouped, tmp_path)
    snap = fleet_ledger.snapshot(grouped)
    assert snap.samples == len(records) == 43 and len({r["id"] for r in records}) == 43
    assert snap.tokens == sum(r["completion_tokens"] for r in records)
    assert fleet_ledger.snapshot(capped).samples == 17  # the cap holds sample by sample inside groups
    assert sim.stats()["requests"] - requests == 43 + 17
