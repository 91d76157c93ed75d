"""Publishing generate tasks to the Celery queue (the producer's side of ``workers.app``)."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal

from celery import Celery

from producer.source import Sample
from workers.messages import (
    DATASET_STAMP,
    GENERATE_GROUP_TASK,
    GENERATE_TASK,
    QUEUE_NAME,
    SAMPLE_ID_HEADER,
    SAMPLE_IDS_HEADER,
)

#: Samples per message at most.
MAX_GROUP: Final = 32
#: Messages per server batch: a worker takes a message once it has room for its samples, so a group is
#: about this fraction of what the servers run at once (a message's cost is shared by its samples).
GROUPS_PER_BATCH: Final = 8


def group_size(wanted_inflight: int | None) -> int:
    """Samples per message for servers that run ``wanted_inflight`` generations at once (the sum of their
    caps; None: unknown, taken as 256)."""
    return max(1, min(MAX_GROUP, math.ceil((wanted_inflight or 256) / GROUPS_PER_BATCH)))


class GroupSizer:
    """``samples_per_task = "auto"``: each dataset's messages are sized from its servers' caps, so nobody
    has to choose a group size; it says what it chose."""

    def __init__(
        self, wanted_inflight: dict[str, int | None], say: Callable[[str], None] = lambda _: None
    ) -> None:
        self._wanted = wanted_inflight
        self._say = say
        self._lock = threading.Lock()
        self._chosen: dict[str, int] = {}

    def __call__(self, dataset: str) -> int:
        wanted = self._wanted.get(dataset)
        k = group_size(wanted)
        with self._lock:
            if self._chosen.get(dataset) == k:
                return k
            self._chosen[dataset] = k
        shown = f"{wanted:,}" if wanted else "unknown (taken as 256)"
        self._say(f"{dataset}: {k} sample(s) per task ({shown} generations at once on its servers)")
        return k


class TaskPublisher:
    """Sends the samples as tasks: one task per sample, or per group of ``samples_per_task`` samples
    (short answers: the Celery cost of a message is shared by the group; a worker runs its samples at
    once, each admitted, leased and committed on its own).

    The dataset rides three ways: in the kwargs (Flower shows and searches them: ``kwargs:dataset=NAME``),
    as a Celery stamped header (``celery -A workers.app control revoke_by_stamped_headers dataset=NAME``),
    and, with the sample ids, in the message headers the ledger's queue purge and audit read.
    """

    def __init__(
        self,
        app: Celery,
        samples_per_task: int | Literal["auto"] = 1,
        sizer: Callable[[str], int] | None = None,
    ) -> None:
        self.app = app
        self.samples_per_task = samples_per_task
        self.sizer = sizer

    def group_size(self, dataset: str) -> int:
        if self.samples_per_task == "auto":
            return self.sizer(dataset) if self.sizer is not None else group_size(None)
        return max(1, self.samples_per_task)

    def __call__(self, dataset: str, samples: Sequence[Sample]) -> None:
        k = self.group_size(dataset)
        with self.app.producer_or_acquire() as producer:
            if k == 1:
                for sample in samples:
                    payload = sample.to_task_payload()
                    sample_id = payload.pop("sample_id")
                    kwargs = {"dataset": dataset, "sample_id": sample_id, "sample": payload}
                    shown = {"dataset": dataset, "sample_id": sample_id}
                    self._send(producer, GENERATE_TASK, dataset, kwargs, shown, {SAMPLE_ID_HEADER: sample_id})
                return
            for start in range(0, len(samples), k):
                group = [s.to_task_payload() for s in samples[start : start + k]]
                ids = [p["sample_id"] for p in group]
                kwargs = {"dataset": dataset, "samples": group}
                shown = {"dataset": dataset, "sample_ids": ids}
                self._send(producer, GENERATE_GROUP_TASK, dataset, kwargs, shown, {SAMPLE_IDS_HEADER: ids})

    def _send(
        self,
        producer: Any,
        task: str,
        dataset: str,
        kwargs: dict[str, Any],
        shown: dict[str, Any],
        headers: dict[str, Any],
    ) -> None:
        self.app.send_task(
            task,
            kwargs=kwargs,
            queue=QUEUE_NAME,
            producer=producer,
            # What Flower shows and searches (it parses this repr as a dict): the dataset and the samples'
            # ids, not the prompts. Celery's own repr of the kwargs cuts a long prompt at 1,024
            # characters, which Flower can no longer parse, and costs a saferepr per task.
            argsrepr="()",
            kwargsrepr=repr(shown),
            stamped_headers=[DATASET_STAMP],
            headers=headers,
            **{DATASET_STAMP: dataset},
        )
