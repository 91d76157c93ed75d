"""Worker settings. Workers need only ``TOKENFLEET_REDIS_URL``: everything about a dataset (servers,
sampling, limits) comes from the ledger at each task, so a running worker never acts on a stale config.
The rest are knobs with safe defaults, read from the environment once at start.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Final

from budget import defaults
from budget.urls import redis_url_from_env
from workers.heartbeat import HEARTBEAT_EVERY_S

#: Redis broker visibility timeout: a message not acknowledged in this time is delivered again. It must
#: exceed the longest generation (request timeout 1800 s by default, plus retries), or a running task's
#: message would be handed to a second worker (kombu redis transport, ``visibility_timeout``). A second
#: delivery is harmless (the sample's lease drops it) but wasteful.
DEFAULT_VISIBILITY_TIMEOUT_S: Final = 7200

#: A generation's lease in the ledger lives this long without renewal; a worker renews every quarter.
DEFAULT_LEASE_S: Final = defaults.LEASE_S

#: Seconds between a worker's heartbeats while its facts do not change (it beats at once when they do).
DEFAULT_HEARTBEAT_S: Final = HEARTBEAT_EVERY_S

#: Generations a worker process runs at once where a server has no cap (``--concurrency``); where the
#: servers have caps, the process's room follows them (``workers.room``).
DEFAULT_CONCURRENCY: Final = 32

#: Celery task threads per process of ``tokenfleet worker``. A task only admits its group of samples and
#: hands them to the generation pool, so two keep up; each holds one message while it waits for room,
#: and messages held there run after the rest of the queue if this process holds fewer server slots than
#: another. With 32 threads (a message of 8 samples each, at 64 in flight, two processes) the samples of a
#: run started a median 104 places from their place in the source; with 2, a median 5 (90% within 13).
TASK_THREADS: Final = 2


#: How ``tokenfleet worker`` tells its Celery worker the ``--concurrency`` it was given.
CONCURRENCY_ENV: Final = "TOKENFLEET_WORKER_CONCURRENCY"


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return float(raw) if raw else default


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    redis_url: str
    visibility_timeout_s: float
    lease_s: float
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    #: ``tokenfleet worker --concurrency`` (None under a plain ``celery worker``: its own --concurrency).
    concurrency: int | None = None

    @classmethod
    def from_env(cls) -> WorkerSettings:
        return cls(
            redis_url=redis_url_from_env(),
            visibility_timeout_s=_env_float("TOKENFLEET_VISIBILITY_TIMEOUT_S", DEFAULT_VISIBILITY_TIMEOUT_S),
            lease_s=_env_float("TOKENFLEET_LEASE_S", DEFAULT_LEASE_S),
            heartbeat_s=_env_float("TOKENFLEET_HEARTBEAT_S", DEFAULT_HEARTBEAT_S),
            concurrency=int(os.environ[CONCURRENCY_ENV]) if os.environ.get(CONCURRENCY_ENV) else None,
        )

    @property
    def lease_ms(self) -> int:
        return int(self.lease_s * 1000)
