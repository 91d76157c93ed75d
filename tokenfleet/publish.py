"""Publishing generate tasks to the Celery queue (the producer's side of ``workers.app``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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


class TaskPublisher:
    """Sends the samples as tasks: one task per sample, or per group of ``samples_per_task`` samples
    (short answers: the Celery cost of a message is shared by the group; a worker runs its samples at
    once, each admitted, leased and committed on its own).

    The dataset rides three ways: in the kwargs (Flower shows and searches them: ``kwargs:dataset=NAME``),
    as a Celery stamped header (``celery -A workers.app control revoke_by_stamped_headers dataset=NAME``),
    and, with the sample ids, in the message headers the ledger's queue purge and audit read.
    """

    def __init__(self, app: Celery, samples_per_task: int = 1) -> None:
        self.app = app
        self.samples_per_task = max(1, samples_per_task)

    def __call__(self, dataset: str, samples: Sequence[Sample]) -> None:
        with self.app.producer_or_acquire() as producer:
            if self.samples_per_task == 1:
                for sample in samples:
                    payload = sample.to_task_payload()
                    sample_id = payload.pop("sample_id")
                    kwargs = {"dataset": dataset, "sample_id": sample_id, "sample": payload}
                    shown = {"dataset": dataset, "sample_id": sample_id}
                    self._send(producer, GENERATE_TASK, dataset, kwargs, shown, {SAMPLE_ID_HEADER: sample_id})
                return
            for start in range(0, len(samples), self.samples_per_task):
                group = [s.to_task_payload() for s in samples[start : start + self.samples_per_task]]
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
