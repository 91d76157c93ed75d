"""The Celery task. Its kwargs carry the dataset and sample id, so Flower shows and searches them
(``kwargs:dataset=NAME``)."""

from __future__ import annotations

import threading
from typing import Any

from budget import Ledger
from workers.app import app, settings
from workers.generate import SampleRunner
from workers.leases import LeaseKeeper
from workers.settings import GENERATE_TASK
from workers.sglang.client import SGLangClient
from workers.sink import OutputSink

_runner: SampleRunner | None = None
_runner_lock = threading.Lock()


def runner() -> SampleRunner:
    """This process's runner, made on first use (after the pool forks or starts its threads)."""
    global _runner
    with _runner_lock:
        if _runner is None:
            ledger = Ledger.from_url(settings.redis_url)
            _runner = SampleRunner(
                ledger=ledger,
                client=SGLangClient(),
                sink=OutputSink(),
                keeper=LeaseKeeper(ledger, settings.lease_ms),
                lease_ms=settings.lease_ms,
            )
        return _runner


@app.task(name=GENERATE_TASK, acks_late=True, ignore_result=True)
def generate(dataset: str, sample_id: str, sample: dict[str, Any]) -> dict[str, Any]:
    return runner().run(dataset, {**sample, "sample_id": sample_id}).as_dict()
