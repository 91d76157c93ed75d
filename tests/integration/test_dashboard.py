"""The Grafana dashboard against a real Prometheus that scraped ``tokenfleet metrics`` during a fleet run.

Prometheus is the Debian package's binary (``.ci/run`` installs it when missing), started with the compose
service's own flags and ``compose/monitoring/prometheus.yml`` pointed at a local metrics server and set to
scrape every second. A fleet (its own Redis, a worker process, the simulator over HTTP) runs two datasets
to the end, one stopped by a token budget and one by a sample cap. Then every panel's query, with the
dashboard's variables filled in as Grafana would, is evaluated through Prometheus's HTTP API, as an instant
query or over the run as Grafana's range query, and must return data; every metric a panel names must be
one Prometheus scraped. Grafana itself is not run here (tests/unit/test_dashboard_files.py checks the
dashboard and provisioning files with Grafana's SDK).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson
import pytest
from ruamel.yaml import YAML

from budget import Ledger
from tests.support.env import IN_CI
from tests.support.files import write_config
from tests.support.fleet import PrivateFleet, submit, token_rows, wait_until
from tests.support.monitoring import (
    PanelQuery,
    Prometheus,
    compose_prometheus_args,
    fill_in,
    load_dashboard,
    local_prometheus_config,
    metric_names,
    panel_queries,
    prometheus_binary,
    variable_query,
    variables,
)
from tokenfleet.metrics import make_metrics_server
from tokenfleet.processes import free_port
from tokenfleet.sim import SimConfig, SimServerThread
from workers.version import full_version

pytestmark = pytest.mark.integration

SCRAPE_INTERVAL_S: Final = 1.0
BUDGETED, CAPPED = "dash_budgeted", "dash_capped"
TOKEN_BUDGET, MAX_SAMPLES = 2_400, 40
WORKER = "dash-worker"


@dataclass
class Run:
    prometheus: Prometheus
    ledger: Ledger
    sim_url: str
    #: Unix time just before the run was submitted, and once Prometheus had scraped it settled.
    start: float
    end: float
    dashboard: dict[str, Any]


def prometheus_or_skip() -> str:
    binary = prometheus_binary()
    if binary is None:
        reason = "prometheus is not installed (apt-get install prometheus; .ci/run does it)"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    return binary


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    binary = prometheus_or_skip()
    root = tmp_path_factory.mktemp("dashboard")
    with contextlib.ExitStack() as stack:
        fleet = PrivateFleet(root / "fleet")
        stack.callback(fleet.close)
        server = SimServerThread(
            SimConfig(port=0, step_time_s=0.01, fixed_output_len=40, max_running_requests=6)
        ).start()
        stack.callback(server.stop)
        metrics_port = free_port()
        metrics = make_metrics_server(fleet.url, "127.0.0.1", metrics_port)
        stack.callback(metrics.server_close)
        threading.Thread(target=metrics.serve_forever, name="metrics", daemon=True).start()
        stack.callback(metrics.shutdown)
        fleet.start_worker(WORKER, concurrency=8)

        config = root / "prometheus" / "prometheus.yml"
        config.parent.mkdir()
        with config.open("w") as out:
            YAML(typ="safe").dump(
                local_prometheus_config(f"127.0.0.1:{metrics_port}", SCRAPE_INTERVAL_S), out
            )
        port = free_port()
        args = compose_prometheus_args(root / "prometheus" / "data", config, port)
        prometheus = Prometheus(binary, root / "prometheus", args, port)
        stack.callback(prometheus.stop)
        wait_until(
            lambda: any(t["health"] == "up" for t in prometheus.targets_up()),
            what="a first scrape",
            timeout_s=20,
        )

        job = write_config(
            root / "job",
            redis_url=fleet.url,
            servers=[server.url],
            datasets=[
                {"name": BUDGETED, "rows": token_rows(400, seed=3), "token_budget": TOKEN_BUDGET},
                {"name": CAPPED, "rows": token_rows(400, seed=4), "max_samples": MAX_SAMPLES},
            ],
        )
        start = time.time()
        assert submit(job, "--window", "32") == 0
        wait_until(
            lambda: [s["value"][1] for s in prometheus.query("tokenfleet_dataset_settled")] == ["1", "1"],
            what="a scrape of both datasets settled",
            timeout_s=20,
        )
        ledger = fleet.ledger()
        stack.callback(ledger.client.close)
        yield Run(prometheus, ledger, server.url, start, time.time(), load_dashboard())


def panel_problems(
    prometheus: Prometheus, queries: Sequence[PanelQuery], values: Mapping[str, Sequence[str]], start: float
) -> list[str]:
    """What is wrong with each panel query against ``prometheus``: no data (instant, or over the run from
    ``start`` for a range query), or a metric name Prometheus never scraped."""
    known = prometheus.metric_names()
    problems = []
    for q in queries:
        expr = fill_in(q.expr, values, SCRAPE_INTERVAL_S)
        unknown = metric_names(expr) - known
        if unknown:
            problems.append(f"{q.name}: names metrics Prometheus never scraped: {sorted(unknown)}")
        if q.instant:
            result = prometheus.query(expr)
        else:
            result = prometheus.query_range(expr, start, time.time(), SCRAPE_INTERVAL_S)
        if not result:
            problems.append(f"{q.name}: no data for {expr}")
    return problems


def variable_values(prometheus: Prometheus, dashboard: Mapping[str, Any]) -> dict[str, list[str]]:
    out = {}
    for variable in variables(dashboard):
        metric, label = variable_query(variable)
        out[variable["name"]] = prometheus.label_values(label, metric)
    return out


def test_the_dashboard_variables_list_the_runs_datasets_and_server(run: Run) -> None:
    values = variable_values(run.prometheus, run.dashboard)

    assert values == {"dataset": sorted([BUDGETED, CAPPED]), "server": [run.sim_url]}


def test_every_panel_query_returns_data_from_prometheus(run: Run) -> None:
    queries = panel_queries(run.dashboard)
    values = variable_values(run.prometheus, run.dashboard)

    problems = panel_problems(run.prometheus, queries, values, run.start)

    assert len(queries) >= 30
    assert problems == []


def test_a_panel_naming_a_metric_that_does_not_exist_is_reported(run: Run) -> None:
    dashboard = orjson.loads(orjson.dumps(run.dashboard))
    [panel] = [p for p in dashboard["panels"] if p["title"] == "Tokens against budget"]
    panel["targets"][0]["expr"] = panel["targets"][0]["expr"].replace("dataset_tokens", "dataset_token")
    [ratio] = [p for p in dashboard["panels"] if p["title"] == "Token budget used"]
    ratio["targets"][0]["expr"] = "sum(tokenfleet_dataset_tokenz) or vector(1)"  # has data, names a typo
    values = variable_values(run.prometheus, dashboard)

    problems = panel_problems(run.prometheus, panel_queries(dashboard), values, run.start)

    assert problems == [
        "'Token budget used' A: names metrics Prometheus never scraped: ['tokenfleet_dataset_tokenz']",
        "'Tokens against budget' A: names metrics Prometheus never scraped: ['tokenfleet_dataset_token']",
        "'Tokens against budget' A: no data for "
        'tokenfleet_dataset_token{dataset=~"(dash_budgeted|dash_capped)"}',
    ]


def test_prometheus_saw_the_run_as_it_went_and_ends_on_the_ledgers_figures(run: Run) -> None:
    window = f"{int(run.end - run.start) + 5}s"

    def by_dataset(expr: str) -> dict[str, float]:
        return {s["metric"]["dataset"]: float(s["value"][1]) for s in run.prometheus.query(expr)}

    last = by_dataset("tokenfleet_dataset_committed_tokens_total")
    first = by_dataset(f"min_over_time(tokenfleet_dataset_committed_tokens_total[{window}])")
    busiest = run.prometheus.query(f"max_over_time(sum(tokenfleet_dataset_inflight)[{window}:1s])")
    snaps = {name: run.ledger.snapshot(name) for name in (BUDGETED, CAPPED)}
    workers = run.prometheus.query("tokenfleet_worker_info")

    assert last == {name: snap.tokens for name, snap in snaps.items()}
    assert snaps[BUDGETED].state == "exhausted" and snaps[CAPPED].samples == MAX_SAMPLES
    assert all(first[name] < last[name] for name in last)  # scraped while the tokens grew
    assert float(busiest[0]["value"][1]) > 0  # and while generations ran
    assert by_dataset("tokenfleet_dataset_samples / tokenfleet_dataset_max_samples") == {CAPPED: 1.0}
    assert [(w["metric"]["worker"].split("@")[0], w["metric"]["version"]) for w in workers] == [
        (WORKER, full_version())
    ]
    assert [s["value"][1] for s in run.prometheus.query("sum(tokenfleet_worker_stale)")] == ["0"]
