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

#: Redis broker visibility timeout: a message not acknowledged in this time is delivered again (kombu
#: redis transport, ``visibility_timeout``). A running task renews its message's delivery time every
#: quarter of it (``workers.running``), so only the messages of a worker that died come back: their samples
#: were fed again once their leases expired, and the second delivery is dropped as done.
DEFAULT_VISIBILITY_TIMEOUT_S: Final = 7200

#: A generation's lease in the ledger lives this long without renewal; a worker renews every quarter.
DEFAULT_LEASE_S: Final = defaults.LEASE_S

#: Seconds between a worker's heartbeats while its facts do not change (it beats at once when they do).
DEFAULT_HEARTBEAT_S: Final = HEARTBEAT_EVERY_S

#: Task threads per worker process (``--concurrency``): each runs one task, whose samples generate at once.
#: ``samples_per_task = "auto"`` sizes the tasks so that the task threads online hold about
#: ``SPARE_FACTOR`` times the generations the servers run at once (``tokenfleet.publish``).
DEFAULT_CONCURRENCY: Final = 32

#: While every server of a dataset is down and refuses connections (SGLang restarting takes a minute or
#: two to load a model), a generation waits this long for a probe to find one up before its sample goes
#: back to pending, without a strike, to be fed again (``workers.server_picker``, dead servers).
DEFAULT_SERVER_WAIT_S: Final = 60.0


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return float(raw) if raw else default


def server_wait_s_from_env() -> float:
    """``TOKENFLEET_SERVER_WAIT_S``, or ``DEFAULT_SERVER_WAIT_S``."""
    return _env_float("TOKENFLEET_SERVER_WAIT_S", DEFAULT_SERVER_WAIT_S)


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    redis_url: str
    visibility_timeout_s: float
    lease_s: float
    heartbeat_s: float = DEFAULT_HEARTBEAT_S

    @classmethod
    def from_env(cls) -> WorkerSettings:
        return cls(
            redis_url=redis_url_from_env(),
            visibility_timeout_s=_env_float("TOKENFLEET_VISIBILITY_TIMEOUT_S", DEFAULT_VISIBILITY_TIMEOUT_S),
            lease_s=_env_float("TOKENFLEET_LEASE_S", DEFAULT_LEASE_S),
            heartbeat_s=_env_float("TOKENFLEET_HEARTBEAT_S", DEFAULT_HEARTBEAT_S),
        )

    @property
    def lease_ms(self) -> int:
        return int(self.lease_s * 1000)
