"""The Celery tasks and their signal hooks: take a task, get a slot, generate, record.

A task is one sample (``generate``) or a group of ``samples_per_task`` samples of one dataset
(``generate_group``). Its Celery thread admits its samples in one ledger call and runs them at once, one in
its own thread and the others in the generation pool; each waits for a server slot, generates, is recorded
and committed. The task ends when every one of them is recorded, failed or dropped, so Flower shows it
STARTED for as long as its samples generate, and its message is acknowledged only then (late acks). Each
sample is held by its lease in the ledger from its admission to its commit, so a killed worker loses
nothing: the leases expire and the samples are fed again.

What Flower shows:

- SUCCESS: the result lists each sample's outcome (tokens, finish reason, truncated, the attempts).
- FAILURE: a sample failed for good (a 4xx from the server, or the servers kept failing it across
  ``max_strikes`` tasks); the exception carries the server's message or the reason.
- REVOKED, with its reason: dropped without generation (its dataset revoked, paused or at its limit, the
  sample already done), or revoked while it ran (``workers.running``: its generations stopped by rid).

The task's kwargs carry the dataset and the sample ids, so Flower searches them (``kwargs:dataset=NAME``).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Final

import redis
from celery import Task, signals
from celery.exceptions import Ignore
from celery.worker import state as worker_state

from budget import Ledger
from workers.app import app, settings
from workers.collector import settle_collector
from workers.heartbeat import Heartbeat
from workers.leases import LeaseKeeper
from workers.messages import DATASET_STAMP, GENERATE_GROUP_TASK, GENERATE_TASK
from workers.runner import Attempt, Outcome, SampleRunner
from workers.running import RunningTasks
from workers.scheduling import run_as_batch
from workers.sglang.client import SGLangClient
from workers.sink import OutputSink

log = logging.getLogger(__name__)

#: Threads that run the samples of this process's tasks beside each task's own thread (made as needed;
#: each mostly waits on its HTTP stream): the task threads times the largest group the producer sends.
GENERATION_THREADS: Final = 4096
#: The pending reason of a sample whose task was revoked while it ran (the ledger's record of it).
REVOKED_REASON: Final = "revoked"


class SampleFailed(Exception):
    """A sample of the task failed for good: the message is the server's (or the reason), as Flower shows."""


_runner: SampleRunner | None = None
_running: RunningTasks | None = None
_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def runner() -> SampleRunner:
    """This process's runner, made on first use."""
    global _runner
    with _lock:
        if _runner is None:
            ledger = Ledger.from_url(settings.redis_url, patient=True)
            _runner = SampleRunner(
                ledger=ledger,
                client=SGLangClient(),
                sink=OutputSink(),
                keeper=LeaseKeeper(ledger, settings.lease_ms),
                lease_ms=settings.lease_ms,
            )
        return _runner


def running() -> RunningTasks:
    """This process's running tasks (revokes, and their messages' visibility), made on first use."""
    global _running
    r = runner()
    with _lock:
        if _running is None:
            broker = str(app.conf.broker_url or "")
            options = app.conf.broker_transport_options or {}
            _running = RunningTasks(
                is_revoked=lambda task_id: task_id in worker_state.revoked,
                stop_task=lambda task_id: r.stops.stop_owner(task_id, REVOKED_REASON),
                broker=redis.Redis.from_url(broker) if broker.startswith(("redis://", "rediss://")) else None,
                visibility_timeout_s=float(options.get("visibility_timeout", settings.visibility_timeout_s)),
                unacked_index_key=str(options.get("global_keyprefix", ""))
                + str(options.get("unacked_index_key", "unacked_index")),
            )
        return _running


def generation_pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=GENERATION_THREADS, thread_name_prefix="tf-gen")
        return _pool


@app.task(name=GENERATE_TASK, bind=True, acks_late=True, ignore_result=True)
def generate(self: Task, dataset: str, sample_id: str, sample: dict[str, Any]) -> dict[str, Any]:
    """One sample in one message (``samples_per_task = 1``)."""
    return run_task(self, dataset, [{**sample, "sample_id": sample_id}])


@app.task(name=GENERATE_GROUP_TASK, bind=True, acks_late=True, ignore_result=True)
def generate_group(self: Task, dataset: str, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Several samples of one dataset in one message (``samples_per_task``), admitted in one ledger call
    and generated at once."""
    return run_task(self, dataset, samples)


def run_task(task: Task, dataset: str, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Admit ``samples``, generate the admitted ones at once, and end when every one is over."""
    r = runner()
    task_id = str(task.request.id)
    outcomes, attempts = r.admit_many(dataset, samples)
    if not attempts:
        reasons = ", ".join(sorted({o.reason for o in outcomes if o is not None}))
        _report_revoked(task, reasons, f"dropped: {reasons}")
    tracker = running()
    with tracker.running(task_id, _delivery_tag(task_id), [a.lease for a in attempts]) as run:
        pool = generation_pool()
        later: list[Future[tuple[Outcome, int]]] = [
            pool.submit(_run_sample, r, task_id, a) for a in attempts[1:]
        ]
        ran = [_run_sample(r, task_id, attempts[0])] + [f.result() for f in later]
    admitted = iter(ran)
    results: list[dict[str, Any]] = []
    for sample, dropped in zip(samples, outcomes, strict=True):
        entry: dict[str, Any] = {"sample_id": str(sample["sample_id"])}
        if dropped is not None:
            entry |= dropped.as_dict()
        else:
            outcome, tries = next(admitted)
            entry |= outcome.as_dict() | {"attempts": tries}
        results.append(entry)
    failed = [e for e in results if e["outcome"] == "failed"]
    if failed:
        raise SampleFailed(
            f"{len(failed)} of {len(results)} sample(s) failed: "
            + "; ".join(f"{e['sample_id']}: {e['reason']}" for e in failed)
        )
    if run.revoked.is_set():
        for a, (outcome, _) in zip(attempts, ran, strict=True):
            if outcome.outcome == "dropped":  # given back to pending by the runner: say why
                r.ledger.release(a.dataset, a.sid, a.attempt, REVOKED_REASON)
        kept = sum(1 for e in results if e["outcome"] in ("committed", "duplicate"))
        _report_revoked(task, REVOKED_REASON, f"revoked while generating: {kept} sample(s) recorded first")
    return {"dataset": dataset, "samples": results}


def _run_sample(r: SampleRunner, task_id: str, attempt: Attempt) -> tuple[Outcome, int]:
    """Run one admitted sample, its requests tracked as the task's; its outcome and the requests it sent."""
    with r.inflight.owned_by(task_id) as tries:
        try:
            outcome = r.run_admitted(attempt)
        except Exception as e:  # the runner gave the sample back to the ledger; the task says why
            log.exception("%s/%s: generation failed", attempt.dataset, attempt.sid)
            outcome = Outcome("dropped", f"worker_error: {e}")
    return outcome, tries.count


def _delivery_tag(task_id: str) -> str | None:
    """The delivery tag of this task's message (for ``RunningTasks.renew``): Celery keeps it on the
    worker's request, not on the task's context."""
    for _ in range(3):
        try:
            for request in list(worker_state.active_requests):
                if request.id == task_id:
                    tag = getattr(request.message, "delivery_tag", None)
                    return str(tag) if tag else None
            return None
        except RuntimeError:  # the set changed while we copied it (another task started or ended)
            continue
    return None


def _report_revoked(task: Task, reason: str, result: str) -> None:
    """Flower shows a task-revoked event as REVOKED; Ignore acknowledges the message and sends no
    task-succeeded event. Flower shows only Celery's own task fields: the reason rides in ``result``."""
    task.send_event(
        "task-revoked", terminated=False, signum=None, expired=False, reason=reason, result=result
    )
    raise Ignore()


_heartbeat: Heartbeat | None = None


@signals.worker_init.connect
def _schedule_as_batch(**_: Any) -> None:
    # in the main thread, before the worker starts its pools: every thread after inherits the policy
    run_as_batch()


@signals.worker_ready.connect
def _start_heartbeat(sender: Any = None, **_: Any) -> None:
    global _heartbeat
    r = runner()
    threads = getattr(getattr(sender, "controller", None), "concurrency", None)
    _heartbeat = Heartbeat(
        r.ledger,
        str(getattr(sender, "hostname", "") or "worker"),
        lambda: {"concurrency": threads, "inflight": r.keeper.count},
        every_s=settings.heartbeat_s,
    )
    _heartbeat.start()
    r.output_guard.start_flusher()  # held records (a full disk) are written by any process once they fit
    log.warning(
        "tokenfleet worker %s: %s task threads; each runs one task's samples at once, every sample waiting "
        "for a server slot, until all are recorded",
        getattr(sender, "hostname", ""),
        threads,
    )


@signals.worker_ready.connect
def _settle_collector(**_: Any) -> None:
    # after _start_heartbeat: the runner, its clients and pools are made, and stay
    settle_collector()


@signals.worker_shutdown.connect
def _stop_heartbeat(**_: Any) -> None:
    # A warm shutdown: Celery took no more messages and waited for its tasks, whose samples are recorded.
    if _running is not None:
        _running.close()
    if _runner is not None:
        _runner.output_guard.stop_flusher()
    if _heartbeat is not None:
        _heartbeat.stop()


@signals.task_revoked.connect
def _revoked_by_stamp(request: Any = None, expired: bool = False, **_: Any) -> None:
    """``celery control revoke_by_stamped_headers dataset=NAME`` drops tasks only in the workers that got
    the broadcast, and only in memory: record it in the ledger, the truth every worker, the producer and
    ``status`` read. The dataset becomes revoked and the dropped sample pending."""
    if (
        expired
        or request is None
        or getattr(request, "task", None) not in (GENERATE_TASK, GENERATE_GROUP_TASK)
    ):
        return
    stamps = getattr(request, "stamps", None) or {}
    dataset = stamps.get(DATASET_STAMP)
    revoked = worker_state.revoked_stamps.get(DATASET_STAMP) or []
    if not dataset or dataset not in (revoked if isinstance(revoked, list | tuple | set) else [revoked]):
        return
    kwargs = getattr(request, "kwargs", None) or {}
    ledger = runner().ledger
    ledger.revoke(dataset)
    sample_ids = [str(s["sample_id"]) for s in kwargs.get("samples") or []]
    if kwargs.get("sample_id"):
        sample_ids.append(str(kwargs["sample_id"]))
    if sample_ids:
        ledger.unqueue(dataset, sample_ids, "revoked")
    log.info("dataset %s revoked by stamped header; the ledger now says revoked", dataset)
