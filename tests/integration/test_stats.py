"""Reasoning tokens and the numbers per sample, end to end: real worker processes generate on the simulator
over real HTTP (its ``reasoning_fraction`` makes the first part of each answer thinking), and the ledger,
``status --json``, the metrics server and the exports all show the same figures the records hold."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from budget import Ledger
from budget.lengths import bucket_of, percentile
from tests.support.files import read_jsonl, unique, write_config
from tests.support.fleet import Sim, export, submit, token_rows
from tokenfleet.cli import main
from tokenfleet.export import export_dataset
from tokenfleet.metrics import METRICS_PATH, make_metrics_server

pytestmark = pytest.mark.integration

MAX_NEW = 64


def status_figures(redis_url: str, capsys: pytest.CaptureFixture[str], name: str) -> dict[str, Any]:
    """``tokenfleet status --json NAME``'s figures of the dataset."""
    capsys.readouterr()
    assert main(["status", "--json", "--redis-url", redis_url, name]) == 0
    data: dict[str, Any] = orjson.loads(capsys.readouterr().out)
    figures: dict[str, Any] = next(d for d in data["datasets"] if d["name"] == name)
    return figures


@pytest.fixture
def scrape_metrics(fleet_redis_url: str) -> Iterator[Callable[[str], dict[str, float]]]:
    """The metrics server (``tokenfleet metrics``'s own) on a free port over HTTP; the callable scrapes
    it and returns one dataset's ``tokenfleet_dataset_*`` series by name."""
    server = make_metrics_server(fleet_redis_url, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_port}{METRICS_PATH}"

    def scrape(dataset: str) -> dict[str, float]:
        reply = httpx.get(url, timeout=10)
        assert reply.status_code == 200, reply.text
        return {
            s.name.removeprefix("tokenfleet_dataset_"): s.value
            for family in text_string_to_metric_families(reply.text)
            for s in family.samples
            if s.labels.get("dataset") == dataset and "state" not in s.labels
        }

    try:
        yield scrape
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_reasoning_tokens_reach_the_ledger_status_metrics_and_exports(
    workers: Any,
    fleet_redis_url: str,
    fleet_ledger: Ledger,
    sim_factory: Callable[..., Sim],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    scrape_metrics: Callable[[str], dict[str, float]],
) -> None:
    sim = sim_factory(reasoning_fraction=0.25, output_len_mean=40.0)
    name = unique("thinking")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": token_rows(40, seed=3)}],
        sampling={"max_new_tokens": MAX_NEW, "temperature": 0.7},
    )

    assert submit(config, "--no-server-check") == 0

    snap = fleet_ledger.snapshot(name)
    records = export(fleet_ledger, name, tmp_path)
    assert snap.settled and snap.samples == len(records) == 40
    # each answer's first quarter is thinking, as the simulator planned it and the record kept it
    assert all(r["reasoning_tokens"] == r["completion_tokens"] // 4 for r in records)
    reasoning = sum(r["reasoning_tokens"] for r in records)
    assert reasoning > 0
    assert snap.reasoning_tokens == reasoning
    assert (
        snap.answer_tokens
        == snap.tokens - reasoning
        == sum(r["completion_tokens"] - r["reasoning_tokens"] for r in records)
    )
    # a sample hit max_new_tokens when its finish reason is length at MAX_NEW tokens
    hits = [r for r in records if r["finish_reason"]["type"] == "length"]
    assert all(r["completion_tokens"] == MAX_NEW and r["hit_max_new"] for r in hits)
    assert snap.hit_max_new == len(hits) == sum(r["hit_max_new"] for r in records)
    lengths = [r["completion_tokens"] for r in records]
    histogram = dict(Counter(bucket_of(n) for n in lengths))
    assert snap.lengths == histogram

    figures = status_figures(fleet_redis_url, capsys, name)
    assert figures["reasoning_tokens"] == reasoning
    assert figures["answer_tokens"] == snap.tokens - reasoning
    assert figures["tokens_per_sample_mean"] == round(sum(lengths) / 40, 1)
    assert figures["tokens_per_sample_p50"] == percentile(histogram, 50, max(lengths))
    assert figures["tokens_per_sample_p95"] == percentile(histogram, 95, max(lengths))
    assert sorted(lengths)[19] <= figures["tokens_per_sample_p50"]
    assert sorted(lengths)[37] <= figures["tokens_per_sample_p95"] <= max(lengths)
    assert figures["hit_max_new"] == len(hits)
    assert figures["hit_max_new_share"] == round(len(hits) / 40, 4)
    # settled: the projection is what it has, nothing left to generate
    assert (figures["projected_final_tokens"], figures["projected_remaining_tokens"]) == (snap.tokens, 0)
    assert figures["projected_remaining_s"] == 0.0

    series = scrape_metrics(name)
    assert series["reasoning_tokens"] == reasoning
    assert series["answer_tokens"] == snap.tokens - reasoning
    assert series["hit_max_new_samples"] == len(hits)
    assert series["tokens_per_sample_mean"] == pytest.approx(sum(lengths) / 40)
    assert series["tokens_per_sample_p50"] == figures["tokens_per_sample_p50"]
    assert series["tokens_per_sample_p95"] == figures["tokens_per_sample_p95"]

    report = export_dataset(
        fleet_ledger, name, tmp_path / "exports" / f"{name}.speculators.jsonl", format="speculators"
    )
    rows = read_jsonl(report.path)
    assert report.reasoning_tokens == reasoning
    assert len(rows) == 40
    assert sum(row["metadata"]["reasoning_tokens"] for row in rows) == reasoning
    assert all(
        row["metadata"]["reasoning_tokens"] == row["metadata"]["usage"]["completion_tokens"] // 4
        for row in rows
    )


def test_a_generation_cut_by_its_budget_reservation_is_truncated_not_a_max_new_hit(
    workers: Any,
    fleet_redis_url: str,
    fleet_ledger: Ledger,
    sim_factory: Callable[..., Sim],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # every prompt wants 100 tokens: each generation ends at max_new_tokens (48), except those the budget's
    # end cuts at their grants (the ones in flight when it is spent). 8 slots: the budget's horizon is far
    # past 48 until its end (2000 / 8), so the first generations are granted their whole want
    sim = sim_factory(fixed_output_len=100, max_running_requests=8)
    name = unique("capped")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": token_rows(60, seed=4), "token_budget": 2000}],
        sampling={"max_new_tokens": 48, "temperature": 0.7},
    )

    assert submit(config, "--no-server-check") == 0

    snap = fleet_ledger.snapshot(name)
    records = export(fleet_ledger, name, tmp_path)
    whole = [r for r in records if r["completion_tokens"] == 48]
    cut = [r for r in records if r["completion_tokens"] < 48]
    assert (snap.state, snap.tokens, snap.samples) == ("exhausted", 2000, len(records))
    assert whole and cut and len(whole) + len(cut) == len(records)
    assert all(r["hit_max_new"] and not r["truncated"] for r in whole)
    assert all(r["truncated"] and not r["hit_max_new"] for r in cut)
    assert (snap.hit_max_new, snap.truncated) == (len(whole), len(cut))
    assert snap.reasoning_tokens == 0  # the simulator reports none by default

    figures = status_figures(fleet_redis_url, capsys, name)
    assert figures["hit_max_new"] == len(whole)
    assert figures["hit_max_new_share"] == round(len(whole) / len(records), 4)
    # 48's bucket reaches 53; no sample is longer than 48
    assert figures["tokens_per_sample_p95"] == 48
    assert figures["longest_sample_tokens"] == 48
    assert figures["projected_final_tokens"] == 2000


def test_reconcile_rebuilds_reasoning_hits_and_lengths_from_the_records(
    workers: Any, fleet_redis_url: str, fleet_ledger: Ledger, sim_factory: Callable[..., Sim], tmp_path: Path
) -> None:
    sim = sim_factory(reasoning_fraction=0.5, output_len_mean=40.0)
    name = unique("rebuilt")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "rows": token_rows(30, seed=5)}],
        sampling={"max_new_tokens": 40, "temperature": 0.7},
    )
    assert submit(config, "--no-server-check") == 0
    before = fleet_ledger.snapshot(name)
    assert before.reasoning_tokens > 0 and before.hit_max_new > 0
    fleet_ledger.forget(name)  # the ledger is lost; the records remain

    assert main(["reconcile", "--config", str(config)]) == 0

    after = fleet_ledger.snapshot(name)
    assert (after.samples, after.tokens, after.reasoning_tokens, after.hit_max_new) == (
        before.samples,
        before.tokens,
        before.reasoning_tokens,
        before.hit_max_new,
    )
    assert (after.lengths, after.longest) == (before.lengths, before.longest)
    assert after.tokens_per_sample_p95 == before.tokens_per_sample_p95
