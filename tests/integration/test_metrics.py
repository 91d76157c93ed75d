"""``tokenfleet.metrics``: the ledger's per-dataset counters on ``/metrics``, read at each scrape.

The server is the real thing (``python -m tokenfleet.metrics``, which runs ``serve_metrics``) over HTTP,
against a real Redis ledger filled with the ledger's own operations.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from budget import DatasetLimits, Ledger
from budget.server_board import ServerLedger, ServerOutcome
from tests.support.env import TEST_REDIS_URL
from tokenfleet.metrics import GAUGES, STATES, build_collector
from tokenfleet.processes import free_port
from tokenfleet.status_view import project, snapshot_json
from workers.version import full_version

pytestmark = pytest.mark.integration

START_TIMEOUT_S: Final = 20.0
#: Labels of one series, as a hashable key.
Series = tuple[str, tuple[tuple[str, str], ...]]


def parse(text: str) -> dict[Series, float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def gauge(scraped: dict[Series, float], name: str, dataset: str, **labels: str) -> float | None:
    key = (f"tokenfleet_dataset_{name}", tuple(sorted({"dataset": dataset, **labels}.items())))
    return scraped.get(key)


def start_server(redis_url: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tokenfleet.metrics", "--port", str(port), "--redis-url", redis_url],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            httpx.get(base + "/", timeout=1)
            return proc, base
        except httpx.TransportError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_server(proc)
                raise RuntimeError(
                    f"metrics server did not start: {log.read_text(errors='replace')}"
                ) from None
            time.sleep(0.05)


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def metrics_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, base = start_server(TEST_REDIS_URL, tmp_path_factory.mktemp("metrics") / "server.log")
    try:
        yield base + "/metrics"
    finally:
        stop_server(proc)


@pytest.fixture
def scrape(ledger: Ledger, metrics_url: str) -> Callable[[], dict[Series, float]]:
    """Scrapes the server; asking for ``ledger`` flushes the test database first."""

    def get() -> dict[Series, float]:
        r = httpx.get(metrics_url, timeout=10)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain")
        return parse(r.text)

    return get


def run_sample(ledger: Ledger, name: str, sid: str, streamed: int) -> str:
    """Takes ``sid`` from the queue as a worker does and reports ``streamed`` tokens generated so far (as
    its lease keeper does); returns the attempt."""
    attempt = f"attempt-{sid}"
    assert ledger.admit(name, sid, attempt).admission.value == "ok"
    assert ledger.renew_many(name, [(sid, attempt, streamed)]) == [True]
    return attempt


def test_a_scrape_shows_each_datasets_counters_as_the_ledger_holds_them(
    ledger: Ledger, scrape: Callable[[], dict[Series, float]]
) -> None:
    ledger.register("budgeted", DatasetLimits(token_budget=1000, max_samples=10), {"servers": []})
    ledger.register("unlimited", DatasetLimits(), {"servers": []})
    assert ledger.enqueue("budgeted", ["a", "b", "c", "d", "e"], window=10) == [1, 1, 1, 1, 1]
    ledger.commit("budgeted", "a", run_sample(ledger, "budgeted", "a", 100), 100)
    ledger.commit("budgeted", "b", run_sample(ledger, "budgeted", "b", 30), 50, truncated=True)
    ledger.fail("budgeted", "c", run_sample(ledger, "budgeted", "c", 7), "server said 400", wasted_tokens=7)
    run_sample(ledger, "budgeted", "d", 12)  # still generating; "e" still queued
    ledger.set_source("budgeted", total=5, done=True, rejected=2)

    scraped = scrape()

    expected = {
        "tokens": 150,
        "token_budget": 1000,
        "samples": 2,
        "max_samples": 10,
        "truncated": 1,
        "failed": 1,
        "wasted_tokens": 7,
        "inflight": 1,
        "live_tokens": 12,
        "queued": 1,
        "dropped": 0,
        "rejected": 2,
        "source_samples": 5,
        "settled": 0,
    }
    for name, value in expected.items():
        assert gauge(scraped, name, "budgeted") == value, name
    snap = ledger.snapshot("budgeted")
    for g in GAUGES:  # every gauge is the ledger's own figure
        assert gauge(scraped, g.name, "budgeted") == g.value(snap), g.name
    assert gauge(scraped, "state", "budgeted", state="active") == 1
    assert scraped[("tokenfleet_ledger_up", ())] == 1
    # A limit that is not set has no series: tokens / token_budget is defined only where it means something.
    assert gauge(scraped, "tokens", "unlimited") == 0
    assert gauge(scraped, "token_budget", "unlimited") is None
    assert gauge(scraped, "max_samples", "unlimited") is None


def test_values_are_read_at_each_scrape_not_when_the_server_started(
    ledger: Ledger, scrape: Callable[[], dict[Series, float]]
) -> None:
    ledger.register("grows", DatasetLimits(token_budget=500), {"servers": []})
    ledger.enqueue("grows", ["a", "b"], window=10)
    ledger.commit("grows", "a", run_sample(ledger, "grows", "a", 40), 40)
    before = scrape()

    ledger.commit("grows", "b", run_sample(ledger, "grows", "b", 60), 60)
    ledger.register("newcomer", DatasetLimits(max_samples=3), {"servers": []})
    after = scrape()

    assert gauge(before, "tokens", "grows") == 40
    assert gauge(after, "tokens", "grows") == 100
    assert gauge(after, "samples", "grows") == 2
    assert gauge(before, "max_samples", "newcomer") is None
    assert gauge(after, "max_samples", "newcomer") == 3


def test_the_state_gauge_is_one_for_the_current_state_only(
    ledger: Ledger, scrape: Callable[[], dict[Series, float]]
) -> None:
    ledger.register("steered", DatasetLimits(), {"servers": []})
    seen = {}
    for action, state in (("pause", "paused"), ("resume", "active"), ("revoke", "revoked")):
        ledger.set_state("steered", action)
        scraped = scrape()
        seen[state] = {s: gauge(scraped, "state", "steered", state=s) for s in STATES}

    for state, values in seen.items():
        assert values == {s: (1 if s == state else 0) for s in STATES}, state


def test_a_sample_given_back_by_a_worker_counts_as_dropped(
    ledger: Ledger, scrape: Callable[[], dict[Series, float]]
) -> None:
    ledger.register("paused", DatasetLimits(), {"servers": []})
    ledger.enqueue("paused", ["a", "b"], window=10)
    ledger.pause("paused")
    assert ledger.admit("paused", "a", "attempt-a").admission.value == "paused"  # dropped, pending

    scraped = scrape()

    assert gauge(scraped, "dropped", "paused") == 1
    assert gauge(scraped, "queued", "paused") == 1


def test_only_the_metrics_path_serves_metrics(metrics_url: str) -> None:
    base = metrics_url.removesuffix("/metrics")

    assert httpx.get(base + "/", timeout=10).status_code == 200
    assert "/metrics" in httpx.get(base + "/", timeout=10).text
    assert httpx.get(base + "/metrics/x", timeout=10).status_code == 404


def test_an_unreachable_redis_gives_ledger_up_zero_instead_of_a_failed_scrape(tmp_path: Path) -> None:
    proc, base = start_server(f"redis://127.0.0.1:{free_port()}/0", tmp_path / "server.log")
    try:
        r = httpx.get(base + "/metrics", timeout=30)
    finally:
        stop_server(proc)

    assert r.status_code == 200
    scraped = parse(r.text)
    assert scraped[("tokenfleet_ledger_up", ())] == 0
    assert not [name for name, _ in scraped if name.startswith("tokenfleet_dataset_")]


def test_the_collector_registers_without_touching_redis_and_reads_it_at_collect(ledger: Ledger) -> None:
    ledger.register("direct", DatasetLimits(token_budget=77), {"servers": []})
    registry = CollectorRegistry()
    down = CollectorRegistry()

    registry.register(build_collector(ledger))
    down.register(build_collector(Ledger.from_url(f"redis://127.0.0.1:{free_port()}/0")))

    assert gauge(parse(generate_latest(registry).decode()), "token_budget", "direct") == 77
    assert parse(generate_latest(down).decode())[("tokenfleet_ledger_up", ())] == 0


def test_the_counters_equal_the_gauges_and_the_figures_are_the_ones_status_shows(
    ledger: Ledger, scrape: Callable[[], dict[Series, float]]
) -> None:
    ledger.register("counted", DatasetLimits(token_budget=1000), {"servers": []})
    ledger.enqueue("counted", ["a", "b", "c"], window=10)
    ledger.commit("counted", "a", run_sample(ledger, "counted", "a", 120), 120)
    ledger.fail("counted", "b", run_sample(ledger, "counted", "b", 5), "server said 400", wasted_tokens=5)
    run_sample(ledger, "counted", "c", 30)  # in flight: the rates and the ETA are known

    before = ledger.snapshot("counted")
    scraped = scrape()
    snap = ledger.snapshot("counted")
    shown = snapshot_json(snap)

    assert gauge(scraped, "committed_tokens_total", "counted") == 120 == gauge(scraped, "tokens", "counted")
    assert gauge(scraped, "committed_samples_total", "counted") == 1
    assert gauge(scraped, "failed_samples_total", "counted") == 1
    # The rate's window runs to the moment of each read (budget/lua/snapshot.lua), so with nothing
    # committed meanwhile it falls from one read to the next: the scrape's lies between the two around it.
    rate = gauge(scraped, "tokens_per_second", "counted")
    assert snap.tokens_per_s - 1e-9 <= rate <= before.tokens_per_s + 1e-9
    assert snap.tokens_per_s > 0
    # ... and the ETAs, from that rate, rise from one read to the next: the scrape's lie between too
    early, late = project(before), project(snap)
    for series, eta in (("eta_budget_seconds", "eta_budget_s"), ("eta_seconds", "eta_s")):
        lo, hi = getattr(early, eta), getattr(late, eta)
        assert lo is not None and hi is not None
        assert lo - 1e-6 <= gauge(scraped, series, "counted") <= hi + 1e-6
        assert shown[eta] == pytest.approx(hi, abs=0.05)  # status shows the same figure, to 0.1 s
    assert gauge(scraped, "projected_overshoot_tokens", "counted") == shown["projected_overshoot_tokens"]
    assert gauge(scraped, "projected_waste_tokens", "counted") == shown["projected_waste_tokens"]


def test_a_figure_status_shows_as_unknown_has_no_series(
    ledger: Ledger, scrape: Callable[[], dict[Series, float]]
) -> None:
    ledger.register("idle", DatasetLimits(), {"servers": []})  # no budget, no rate, source not counted

    scraped = scrape()

    for name in ("eta_seconds", "eta_budget_seconds", "projected_overshoot_tokens", "projected_waste_tokens"):
        assert gauge(scraped, name, "idle") is None, name
    assert gauge(scraped, "tokens_per_second", "idle") == 0


def test_each_server_on_the_board_has_its_health_load_and_counts_without_credentials(
    ledger: Ledger, scrape: Callable[[], dict[Series, float]]
) -> None:
    board = ServerLedger(ledger.client)
    healthy, failing = "http://127.0.0.1:30001", "http://ops:s3cret@127.0.0.1:30002"
    for token in ("t1", "t2", "t3"):
        assert board.acquire([healthy], [8], token, lease_ms=60_000).url == healthy
    board.release(healthy, "t1")
    assert board.acquire([failing], [None], "t4", lease_ms=60_000).url == failing
    at = board.release(failing, "t4")
    for _ in range(3):
        board.report(failing, ServerOutcome.FAIL, at_ms=at, fail_threshold=3, probe_interval_ms=1000)

    scraped = scrape()

    def server(name: str, url: str) -> float | None:
        return scraped.get((f"tokenfleet_server_{name}", (("server", url),)))

    shown = "http://ops:***@127.0.0.1:30002"
    assert not [labels for _, labels in scraped if any("s3cret" in v for _, v in labels)]
    assert (server("up", healthy), server("up", shown)) == (1, 0)
    assert (server("inflight", healthy), server("inflight", shown)) == (2, 0)
    assert (server("cap", healthy), server("cap", shown)) == (8, None)
    assert (server("requests_started_total", healthy), server("requests_started_total", shown)) == (3, 1)
    assert (server("failures_total", healthy), server("failures_total", shown)) == (0, 3)
    assert server("fails_in_a_row", shown) == 3 and server("downs_total", shown) == 1
    assert server("requests_per_second", healthy) == pytest.approx(0.1)  # 1 finished in the 10 s window


def test_each_worker_online_has_its_code_version_and_one_running_other_code_is_stale(
    ledger: Ledger, scrape: Callable[[], dict[Series, float]]
) -> None:
    ledger.heartbeat(
        "w1@gpu-a", {"version": full_version(), "host": "gpu-a", "inflight": 5, "concurrency": 8}
    )
    ledger.heartbeat("old@gpu-b", {"version": "0.1.0+code.0ld0ld0ld0", "host": "gpu-b", "inflight": 1})

    scraped = scrape()

    info = {
        dict(labels)["worker"]: dict(labels) for name, labels in scraped if name == "tokenfleet_worker_info"
    }
    assert info == {
        "w1@gpu-a": {"worker": "w1@gpu-a", "host": "gpu-a", "version": full_version()},
        "old@gpu-b": {"worker": "old@gpu-b", "host": "gpu-b", "version": "0.1.0+code.0ld0ld0ld0"},
    }

    def worker(name: str, who: str) -> float | None:
        return scraped.get((f"tokenfleet_worker_{name}", (("worker", who),)))

    assert (worker("stale", "w1@gpu-a"), worker("stale", "old@gpu-b")) == (0, 1)
    assert (worker("inflight", "w1@gpu-a"), worker("inflight", "old@gpu-b")) == (5, 1)
    assert (worker("concurrency", "w1@gpu-a"), worker("concurrency", "old@gpu-b")) == (8, None)
    assert scraped[("tokenfleet_metrics_info", (("version", full_version()),))] == 1

    ledger.heartbeat("old@gpu-b", None)  # a worker that stopped is no longer online
    assert "old@gpu-b" not in {dict(labels).get("worker") for _, labels in scrape()}
