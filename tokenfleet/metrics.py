"""Per-dataset counters for Prometheus, read from the ledger at each scrape.

``serve_metrics(redis_url, host, port)`` serves ``/metrics`` in the Prometheus text format (OpenMetrics when
the scraper asks for it). Nothing is cached: every scrape reads ``Ledger.snapshot`` of each dataset in
``Ledger.datasets()``, so the numbers are the ones ``tokenfleet status --json`` shows at that moment.

Every ``tokenfleet_dataset_*`` series has a ``dataset`` label. A limit that is not set (no ``token_budget``,
no ``max_samples``) has no series, so ``tokenfleet_dataset_tokens / tokenfleet_dataset_token_budget`` is
defined exactly for the datasets that have a budget. ``tokenfleet_ledger_up`` is 0 when Redis did not
answer the scrape (every other series is then absent), instead of the scrape failing.

Beside the datasets: each server the workers pick among (``tokenfleet_server_*``, label ``server``, the
URL without credentials), as the fleet-wide server board holds it, and each worker online
(``tokenfleet_worker_*``, label ``worker``) with its code version, as its heartbeat says. Totals that only
grow are counters (``*_total``), so ``rate()`` works on them. The names are listed in
docs/operations.md; the Grafana dashboard in ``compose/monitoring/`` is built on them.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any, Final
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from budget import DatasetSnapshot, Ledger, LedgerError, UnknownDataset
from budget.ledger import DatasetState, connect
from budget.server_board import ServerLedger, ServerStatus
from budget.urls import redact_url, redis_url_from_env
from tokenfleet.status_view import project
from workers.version import full_version

__all__ = [
    "DEFAULT_PORT",
    "METRICS_PATH",
    "LedgerCollector",
    "build_collector",
    "main",
    "make_metrics_server",
    "serve_metrics",
]

log = logging.getLogger(__name__)

#: The port ``tokenfleet metrics`` listens on unless told otherwise.
DEFAULT_PORT: Final = 9808
#: Where the metrics are served.
METRICS_PATH: Final = "/metrics"
PREFIX: Final = "tokenfleet_dataset_"
#: How long one Redis call of a scrape may take (Prometheus' default scrape timeout is 10 s).
SCRAPE_REDIS_TIMEOUT_S: Final = 5.0

WsgiEnviron = dict[str, Any]
StartResponse = Callable[..., Any]
WsgiApp = Callable[[WsgiEnviron, StartResponse], Iterable[bytes]]


@dataclass(frozen=True, slots=True)
class _Gauge:
    """One per-dataset gauge: its name (after ``tokenfleet_dataset_``), help text and value."""

    name: str
    help: str
    value: Callable[[DatasetSnapshot], float | None]


#: The per-dataset gauges, in exposition order. ``dropped`` is the ledger's ``pending``, named as in
#: ``tokenfleet status``.
GAUGES: Final[tuple[_Gauge, ...]] = (
    _Gauge("tokens", "Committed completion tokens.", lambda s: s.tokens),
    _Gauge("token_budget", "Token budget (absent when the dataset has none).", lambda s: s.token_budget),
    _Gauge("samples", "Samples committed (generated, written and counted once).", lambda s: s.samples),
    _Gauge("max_samples", "Sample cap (absent when the dataset has none).", lambda s: s.max_samples),
    _Gauge(
        "failed", "Samples marked failed (reason in the ledger and in failed-*.jsonl).", lambda s: s.failed
    ),
    _Gauge(
        "dropped",
        "Samples taken back without a result (dropped by a limit, pause or revoke, or an expired lease): "
        "pending, fed again when the dataset can go on.",
        lambda s: s.pending,
    ),
    _Gauge("queued", "Tasks waiting in the queue.", lambda s: s.queued),
    _Gauge("inflight", "Generations running now (leases held).", lambda s: s.inflight),
    _Gauge("live_tokens", "Tokens generated so far by in-flight attempts.", lambda s: s.live_tokens),
    _Gauge("truncated", "Committed samples whose generation was cut at the budget.", lambda s: s.truncated),
    _Gauge(
        "discarded_tokens",
        "Tokens generated and thrown away by on_budget = discard (they count against the budget).",
        lambda s: s.discarded_tokens,
    ),
    _Gauge(
        "wasted_tokens",
        "Tokens generated and not committed, for any reason (report only).",
        lambda s: s.wasted_tokens,
    ),
    _Gauge("rejected", "Source lines rejected as invalid (see rejected.jsonl).", lambda s: s.rejected),
    _Gauge("reclaimed", "Leases that expired (a worker died) and were taken back.", lambda s: s.reclaimed),
    _Gauge(
        "source_samples",
        "Samples in the source, once the producer has read it to the end (absent before).",
        lambda s: s.source_total if s.source_done else None,
    ),
    _Gauge("settled", "1 once nothing is left to do for the dataset, else 0.", lambda s: int(s.settled)),
    _Gauge(
        "output_blocked",
        "1 while a worker cannot write the dataset's output (disk full, read-only; reason in status).",
        lambda s: int(bool(s.output_error)),
    ),
    _Gauge(
        "held_samples",
        "Generations whose records the output disk had no room for, held in the ledger until they fit "
        "(counted in inflight too).",
        lambda s: s.held,
    ),
    _Gauge("held_bytes", "Bytes the held records take in the ledger.", lambda s: s.held_bytes),
    _Gauge(
        "reasoning_tokens",
        "Of the committed tokens, those the model spent thinking (SGLang's meta_info.reasoning_tokens).",
        lambda s: s.reasoning_tokens,
    ),
    _Gauge(
        "answer_tokens", "Committed tokens that are not reasoning: the answers.", lambda s: s.answer_tokens
    ),
    _Gauge(
        "hit_max_new_samples",
        "Committed samples whose generation ended at the dataset's max_new_tokens.",
        lambda s: s.hit_max_new,
    ),
    _Gauge(
        "tokens_per_sample_mean",
        "Mean completion tokens per committed sample (absent before the first).",
        lambda s: s.tokens_per_sample,
    ),
    _Gauge(
        "tokens_per_sample_p50",
        "Median completion tokens per sample: the upper bound of its log-scale bucket (4 per doubling).",
        lambda s: s.tokens_per_sample_p50,
    ),
    _Gauge(
        "tokens_per_sample_p95",
        "95th percentile of completion tokens per sample: the upper bound of its log-scale bucket.",
        lambda s: s.tokens_per_sample_p95,
    ),
)

STATES: Final[tuple[str, ...]] = tuple(s.value for s in DatasetState)


@dataclass(frozen=True, slots=True)
class _Figure:
    """One per-dataset series that is not a ledger field as such: a counter of a total that only grows,
    or a figure of ``tokenfleet status`` (its rates and projections)."""

    name: str
    help: str
    value: Callable[[DatasetSnapshot], float | None]


#: Totals that only grow, as counters (exposed with ``_total``): ``rate()`` of them is the fleet's
#: throughput as Prometheus sees it. They equal the gauges of the same figures above.
DATASET_COUNTERS: Final[tuple[_Figure, ...]] = (
    _Figure(
        "committed_tokens",
        "Committed completion tokens (the tokens gauge, as a counter).",
        lambda s: s.tokens,
    ),
    _Figure("committed_samples", "Samples committed (the samples gauge, as a counter).", lambda s: s.samples),
    _Figure("failed_samples", "Samples marked failed (the failed gauge, as a counter).", lambda s: s.failed),
)

#: What ``tokenfleet status`` computes from the ledger: its rates (over the ledger's own window) and its
#: projections (``tokenfleet.status_view.project``). A figure status shows as "-" has no series.
DATASET_FIGURES: Final[tuple[_Figure, ...]] = (
    _Figure(
        "tokens_per_second",
        "Tokens generated per second over the ledger's last 30 s (status: tok/s).",
        lambda s: s.tokens_per_s,
    ),
    _Figure(
        "samples_per_second",
        "Samples committed per second over the ledger's last 30 s (status: samples/s).",
        lambda s: s.samples_per_s,
    ),
    _Figure(
        "eta_seconds",
        "Seconds until the dataset settles at the current rates, 0 once settled (absent while unknown).",
        lambda s: project(s).eta_s,
    ),
    _Figure(
        "eta_budget_seconds",
        "Seconds until the token budget is reached at the current rate (absent: no budget, or no rate).",
        lambda s: project(s).eta_budget_s,
    ),
    _Figure(
        "projected_overshoot_tokens",
        "Tokens past the budget: the actual figure once exhausted, else what on_budget is expected to cost "
        "(absent without a budget).",
        lambda s: project(s).overshoot_tokens,
    ),
    _Figure(
        "projected_waste_tokens",
        "Tokens generated and not kept by on_budget = discard, actual or expected (absent without a budget).",
        lambda s: project(s).waste_tokens,
    ),
)

SERVER_PREFIX: Final = "tokenfleet_server_"
WORKER_PREFIX: Final = "tokenfleet_worker_"


@dataclass(frozen=True, slots=True)
class _ServerFigure:
    """One per-server series from the fleet-wide server board (``budget.server_board``)."""

    name: str
    help: str
    value: Callable[[ServerStatus], float | None]
    counter: bool = False


#: Per server, label ``server``: the board's figures as ``tokenfleet status`` shows them.
SERVER_FIGURES: Final[tuple[_ServerFigure, ...]] = (
    _ServerFigure(
        "up", "1 while the fleet counts the server up, 0 while it is marked down.", lambda s: int(s.up)
    ),
    _ServerFigure(
        "inflight", "Generations in flight on the server, fleet-wide (unexpired slots).", lambda s: s.inflight
    ),
    _ServerFigure(
        "cap", "Fleet-wide cap of generations in flight on it (absent without one).", lambda s: s.cap
    ),
    _ServerFigure(
        "requests_per_second",
        "Requests finished per second over the board's last 10 s.",
        lambda s: s.requests_per_s,
    ),
    _ServerFigure(
        "fails_in_a_row", "Failures in a row now (a success resets it).", lambda s: s.fails_in_a_row
    ),
    _ServerFigure(
        "requests_started", "Generations started on the server.", lambda s: s.started, counter=True
    ),
    _ServerFigure("failures", "Failures reported against the server.", lambda s: s.failures, counter=True),
    _ServerFigure("downs", "Times the server was marked down.", lambda s: s.downs, counter=True),
)


class _WorkerFamilies:
    """The per-worker families of one scrape, and this server's own version."""

    def __init__(self) -> None:
        self.info = InfoMetricFamily(
            WORKER_PREFIX.rstrip("_"),
            "A worker online (a heartbeat within the last 30 s), with its host and code version.",
            labels=["worker", "host", "version"],
        )
        self.stale = GaugeMetricFamily(
            WORKER_PREFIX + "stale",
            "1 when the worker runs other code than this metrics server (tokenfleet_metrics_info), else 0.",
            labels=["worker"],
        )
        self.inflight = GaugeMetricFamily(
            WORKER_PREFIX + "inflight", "Generations the worker runs now.", labels=["worker"]
        )
        self.concurrency = GaugeMetricFamily(
            WORKER_PREFIX + "concurrency",
            "Task threads of the worker, each running one task.",
            labels=["worker"],
        )
        self.age = GaugeMetricFamily(
            WORKER_PREFIX + "heartbeat_age_seconds",
            "Seconds since the worker's last heartbeat (by the Redis server's clock).",
            labels=["worker"],
        )
        self.mine = InfoMetricFamily(
            "tokenfleet_metrics",
            "The code version of this metrics server (the reference for tokenfleet_worker_stale).",
            labels=["version"],
        )

    def all(self) -> list[Metric]:
        return [self.info, self.stale, self.inflight, self.concurrency, self.age, self.mine]


class LedgerCollector(Collector):
    """A Prometheus collector reading every dataset's snapshot, the server board and the workers' heartbeats
    from ``ledger`` at each ``collect()``."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.servers = ServerLedger(ledger.client)
        #: This process's code version, the reference for ``tokenfleet_worker_stale``.
        self.version = full_version()

    def _families(self) -> tuple[GaugeMetricFamily, dict[str, GaugeMetricFamily], GaugeMetricFamily]:
        up = GaugeMetricFamily("tokenfleet_ledger_up", "1 when the ledger's Redis answered this scrape.")
        gauges = {g.name: GaugeMetricFamily(PREFIX + g.name, g.help, labels=["dataset"]) for g in GAUGES}
        state = GaugeMetricFamily(
            PREFIX + "state",
            "The dataset's state: 1 for the current one (" + ", ".join(STATES) + "), 0 for the others.",
            labels=["dataset", "state"],
        )
        return up, gauges, state

    def _dataset_families(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        """One family per ``DATASET_COUNTERS`` then ``DATASET_FIGURES`` entry, in that order."""
        return [
            *(CounterMetricFamily(PREFIX + c.name, c.help, labels=["dataset"]) for c in DATASET_COUNTERS),
            *(GaugeMetricFamily(PREFIX + f.name, f.help, labels=["dataset"]) for f in DATASET_FIGURES),
        ]

    def _server_families(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        return [
            (CounterMetricFamily if f.counter else GaugeMetricFamily)(
                SERVER_PREFIX + f.name, f.help, labels=["server"]
            )
            for f in SERVER_FIGURES
        ]

    def _fleet_families(self) -> list[Metric]:
        """Every family beyond the ledger's dataset fields, without samples, in exposition order."""
        return [*self._dataset_families(), *self._server_families(), *_WorkerFamilies().all()]

    def describe(self) -> Iterator[Metric]:
        """The families without samples: registering the collector does not touch Redis."""
        up, gauges, state = self._families()
        yield up
        yield from gauges.values()
        yield state
        yield from self._fleet_families()

    def collect(self) -> Iterator[Metric]:
        up, gauges, state = self._families()
        try:
            snapshots = self._snapshots()
            servers = self.servers.status()
            workers = self.ledger.workers()
        except LedgerError as e:
            log.warning("metrics scrape: %s", e)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        for snap in snapshots:
            for g in GAUGES:
                value = g.value(snap)
                if value is not None:
                    gauges[g.name].add_metric([snap.name], value)
            for name in STATES:
                state.add_metric([snap.name, name], 1 if snap.state == name else 0)
        yield from gauges.values()
        yield state
        yield from self._fleet(snapshots, servers, workers)

    def _fleet(
        self,
        snapshots: Sequence[DatasetSnapshot],
        servers: Sequence[ServerStatus],
        workers: Sequence[dict[str, Any]],
    ) -> Iterator[Metric]:
        figures = (*DATASET_COUNTERS, *DATASET_FIGURES)
        for family, figure in zip(self._dataset_families(), figures, strict=True):
            for snap in snapshots:
                value = figure.value(snap)
                if value is not None:
                    family.add_metric([snap.name], value)
            yield family
        for family, server_figure in zip(self._server_families(), SERVER_FIGURES, strict=True):
            for server in servers:
                value = server_figure.value(server)
                if value is not None:
                    family.add_metric([redact_url(server.url)], value)
            yield family
        w = _WorkerFamilies()
        for facts in workers:
            name = str(facts["name"])
            version = str(facts.get("version") or "")
            w.info.add_metric([name, str(facts.get("host") or ""), version], {})
            w.stale.add_metric([name], int(version != self.version))
            for family, field in ((w.inflight, "inflight"), (w.concurrency, "concurrency")):
                value = facts.get(field)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    family.add_metric([name], value)
            w.age.add_metric([name], float(facts.get("age_s") or 0.0))
        w.mine.add_metric([self.version], {})
        yield from w.all()

    def _snapshots(self) -> list[DatasetSnapshot]:
        out = []
        for name in self.ledger.datasets():
            # A dataset forgotten between the two reads is simply not there any more.
            with contextlib.suppress(UnknownDataset):
                out.append(self.ledger.snapshot(name))
        return out


def build_collector(ledger: Ledger) -> LedgerCollector:
    """The collector of ``ledger``'s per-dataset gauges, to register in any ``CollectorRegistry``."""
    return LedgerCollector(ledger)


def _not_found(environ: WsgiEnviron, start_response: StartResponse) -> list[bytes]:
    if environ.get("PATH_INFO", "/") == "/":
        start_response("200 OK", [("Content-Type", "text/plain; charset=utf-8")])
        return [f"tokenfleet metrics: {METRICS_PATH}\n".encode()]
    start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
    return [f"not found: the metrics are at {METRICS_PATH}\n".encode()]


def metrics_app(ledger: Ledger) -> WsgiApp:
    """A WSGI app serving ``ledger``'s gauges on ``/metrics`` (and a pointer to it on ``/``)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(build_collector(ledger))
    metrics = make_wsgi_app(registry)

    def app(environ: WsgiEnviron, start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == METRICS_PATH:
            result: Iterable[bytes] = metrics(environ, start_response)
            return result
        return _not_found(environ, start_response)

    return app


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def make_metrics_server(redis_url: str, host: str, port: int) -> WSGIServer:
    """A bound, not yet serving, HTTP server for the ledger at ``redis_url`` (call ``serve_forever``)."""
    # A scrape waits for Redis at most SCRAPE_REDIS_TIMEOUT_S, then answers with tokenfleet_ledger_up 0.
    ledger = Ledger(connect(redis_url, socket_timeout=SCRAPE_REDIS_TIMEOUT_S))
    return make_server(
        host, port, metrics_app(ledger), server_class=_ThreadingServer, handler_class=_QuietHandler
    )


def serve_metrics(redis_url: str, host: str, port: int) -> None:
    """Serve the ledger's per-dataset gauges on ``http://host:port/metrics`` until interrupted."""
    server = make_metrics_server(redis_url, host, port)
    try:
        server.serve_forever()
    finally:
        server.server_close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tokenfleet.metrics [--host H] [--port P] [--redis-url URL]``."""
    p = argparse.ArgumentParser(prog="tokenfleet metrics", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--redis-url", help="the ledger's Redis (default: $TOKENFLEET_REDIS_URL or local)")
    args = p.parse_args(argv)
    url = args.redis_url or redis_url_from_env()
    print(f"tokenfleet metrics on http://{args.host}:{args.port}{METRICS_PATH}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        serve_metrics(url, args.host, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
