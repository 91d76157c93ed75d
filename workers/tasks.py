"""The Celery task and its signal hooks.

The task's kwargs carry the dataset and sample id, so Flower shows and searches them
(``kwargs:dataset=NAME``). A task dropped without generation (its dataset revoked, paused or at its
limit, or the sample already done) is reported to Flower as revoked, with the reason, not as a success.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from celery import Task, signals
from celery.exceptions import Ignore
from celery.worker import state as worker_state

from budget import Ledger
from workers.app import app, settings
from workers.heartbeat import Heartbeat
from workers.leases import LeaseKeeper
from workers.messages import DATASET_STAMP, GENERATE_GROUP_TASK, GENERATE_TASK
from workers.room import MAX_ROOM, SPARE_MAX, ProcessRoom
from workers.runner import Attempt, SampleRunner
from workers.sglang.client import SGLangClient
from workers.sink import OutputSink

log = logging.getLogger(__name__)

_runner: SampleRunner | None = None
_runner_lock = threading.Lock()


def runner() -> SampleRunner:
    """This process's runner, made on first use."""
    global _runner
    with _runner_lock:
        if _runner is None:
            ledger = Ledger.from_url(settings.redis_url, patient=True)
            _runner = SampleRunner(
                ledger=ledger,
                client=SGLangClient(),
                sink=OutputSink(),
                keeper=LeaseKeeper(ledger, settings.lease_ms),
                lease_ms=settings.lease_ms,
            )
            room.follow(_runner.picker.held)
            _runner.picker.on_slots = room.wake
        return _runner


@app.task(name=GENERATE_TASK, bind=True, acks_late=True, ignore_result=True)
def generate(self: Task, dataset: str, sample_id: str, sample: dict[str, Any]) -> dict[str, Any]:
    """One sample in one message (``samples_per_task = 1``): admitted and run as a group of one, so it
    takes the process's room, not a task thread, while it generates."""
    return _admit_and_start(self, dataset, [{**sample, "sample_id": sample_id}])


_heartbeat: Heartbeat | None = None


@signals.worker_ready.connect
def _start_heartbeat(sender: Any = None, **_: Any) -> None:
    global _heartbeat
    r = runner()
    threads = getattr(getattr(sender, "controller", None), "concurrency", None)
    concurrency = settings.concurrency or threads
    if isinstance(concurrency, int):
        room.default(concurrency)
    _heartbeat = Heartbeat(
        r.ledger,
        str(getattr(sender, "hostname", "") or "worker"),
        lambda: {"concurrency": concurrency, "inflight": r.keeper.count, "room": room.limit},
        every_s=settings.heartbeat_s,
    )
    _heartbeat.start()
    r.output_guard.start_flusher()  # held records (a full disk) are written by any process once they fit
    log.warning(
        "tokenfleet worker %s: %s task threads take messages while this process has room: %d generations "
        "at once until it runs a dataset whose servers have caps, then their sum and as many again (at most "
        "%d more), and at most twice the server slots it holds",
        getattr(sender, "hostname", ""),
        threads,
        room.limit,
        SPARE_MAX,
    )


@signals.worker_shutdown.connect
def _stop_heartbeat(**_: Any) -> None:
    # A warm shutdown: Celery took no more messages and its tasks returned; the generations they started
    # finish and commit here (``docker compose stop`` waits ``stop_grace_period`` for it).
    pool = _generation_pool
    if pool is not None:
        if room.used:
            log.warning("waiting for %d generation(s) in flight to finish and commit", room.used)
        pool.shutdown(wait=True)
    if _runner is not None:
        _runner.output_guard.stop_flusher()
    if _heartbeat is not None:
        _heartbeat.stop()


#: The generations this process runs at once (``workers.room``).
room = ProcessRoom()
_generation_pool: ThreadPoolExecutor | None = None


def generation_pool() -> ThreadPoolExecutor:
    """Threads that run admitted samples (each thread mostly waits on its HTTP stream); made as needed."""
    global _generation_pool
    with _runner_lock:
        if _generation_pool is None:
            _generation_pool = ThreadPoolExecutor(max_workers=MAX_ROOM, thread_name_prefix="tf-gen")
        return _generation_pool


def _run_in_room(attempt: Attempt) -> None:
    """Run one admitted sample; its room is free once its generation is recorded (its commit may wait a
    moment for others to share the ledger call) or once it ends otherwise."""
    freed: list[bool] = []

    def free() -> None:
        if not freed:
            freed.append(True)
            room.give(1)

    try:
        runner().run_admitted(replace(attempt, on_generated=free))
    except Exception:  # the runner gave the sample back to the ledger; say why here
        log.exception("%s/%s: generation failed", attempt.dataset, attempt.sid)
    finally:
        free()


@app.task(name=GENERATE_GROUP_TASK, bind=True, acks_late=True, ignore_result=True)
def generate_group(self: Task, dataset: str, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Several samples of one dataset in one message (``samples_per_task``), admitted in one ledger call
    once this process has room for them. Each admitted sample then runs in the generation pool on its own
    (leased, generated, recorded and committed as ``generate`` does for one), and the task returns: its
    message is acknowledged once its samples are admitted. From there the ledger holds them: a process
    killed mid-generation leaves leases that expire, and submit feeds those samples again."""
    return _admit_and_start(self, dataset, samples)


def _admit_and_start(task: Task, dataset: str, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Wait for room for ``samples``, admit them in one ledger call, and start the admitted ones in the
    generation pool; report the task as revoked when none was admitted."""
    r = runner()
    room.take(len(samples))
    try:
        outcomes, attempts = r.admit_many(dataset, samples)
    except BaseException:
        room.give(len(samples), ended=False)
        raise
    room.give(len(samples) - len(attempts), ended=False)
    if attempts:
        room.fit(dataset, attempts[0].spec.max_inflight_per_server)
    pool = generation_pool()
    for attempt in attempts:
        pool.submit(_run_in_room, attempt)
    dropped = [o for o in outcomes if o is not None]
    if not attempts:
        _report_dropped(task, ", ".join(sorted({o.reason for o in dropped})))
    return {
        "admitted": len(attempts),
        "dropped": [
            o.as_dict() | {"sample_id": str(s["sample_id"])}
            for s, o in zip(samples, outcomes, strict=True)
            if o is not None
        ],
    }


def _report_dropped(task: Task, reason: str) -> None:
    """Flower shows a task-revoked event as REVOKED; Ignore acknowledges the message and sends no
    task-succeeded event. Flower shows only Celery's own task fields: the reason rides in ``result``."""
    task.send_event(
        "task-revoked",
        terminated=False,
        signum=None,
        expired=False,
        reason=reason,
        result=f"dropped: {reason}",
    )
    raise Ignore()


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
