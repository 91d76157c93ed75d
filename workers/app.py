"""The Celery app: ``celery -A workers.app worker`` or ``tokenfleet worker``.

Settings fit long generations: a threads pool (a task thread waits on its samples' HTTP streams), late
acks (a message is acknowledged once every sample of its task is recorded, failed or dropped), one message
prefetched per thread, a visibility timeout the running tasks renew (``workers.running``), JSON only on
the wire, no result backend (the ledger and the output files are the record), task events on for Flower.
"""

from __future__ import annotations

import logging

from celery import Celery

from workers.broker_clients import reuse_broker_clients
from workers.messages import GENERATE_GROUP_TASK, GENERATE_TASK, QUEUE_NAME
from workers.settings import DEFAULT_CONCURRENCY, WorkerSettings

log = logging.getLogger(__name__)
settings = WorkerSettings.from_env()
#: httpx logs every request at INFO (the worker's default level): one line per abort, so a stop of a few
#: thousand generations wrote as many lines. Its warnings and errors still show.
logging.getLogger("httpx").setLevel(logging.WARNING)


def make_app(broker_url: str, visibility_timeout_s: float = settings.visibility_timeout_s) -> Celery:
    """A Celery app on ``broker_url`` with the fleet's settings (workers, and producers that publish)."""
    if not reuse_broker_clients():
        log.warning("kombu's Redis channel has no conn_or_acquire: broker commands build a client each")
    app = Celery("tokenfleet", broker=broker_url, include=["workers.tasks"])
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        event_serializer="json",
        task_ignore_result=True,
        result_backend=None,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        # Generations are long HTTP streams: threads, not processes (``celery -A workers.app worker`` too).
        worker_pool="threads",
        worker_concurrency=DEFAULT_CONCURRENCY,
        broker_transport_options={"visibility_timeout": visibility_timeout_s},
        broker_connection_retry_on_startup=True,
        task_default_queue=QUEUE_NAME,
        task_routes={GENERATE_TASK: {"queue": QUEUE_NAME}, GENERATE_GROUP_TASK: {"queue": QUEUE_NAME}},
        worker_send_task_events=True,
        # No task-sent events: one more PUBLISH per task on the producer's hot path (a third of its time
        # in a profile); Flower learns of each task from the worker's task-received event.
        task_send_sent_event=False,
        task_track_started=True,
        worker_hijack_root_logger=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )
    return app


app = make_app(settings.redis_url)
