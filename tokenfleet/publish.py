"""Publishing generate tasks to the Celery queue (the producer's side of ``workers.app``)."""

from __future__ import annotations

from collections.abc import Sequence

from celery import Celery

from producer.source import Sample
from workers.settings import DATASET_STAMP, GENERATE_TASK, QUEUE_NAME, SAMPLE_ID_HEADER


class TaskPublisher:
    """Sends one task per sample.

    The dataset rides three ways: in the kwargs (Flower shows and searches them: ``kwargs:dataset=NAME``),
    as a Celery stamped header (``celery -A workers.app control revoke_by_stamped_headers dataset=NAME``),
    and, with the sample id, in the message headers the ledger's queue purge reads.
    """

    def __init__(self, app: Celery) -> None:
        self.app = app

    def __call__(self, dataset: str, samples: Sequence[Sample]) -> None:
        with self.app.producer_or_acquire() as producer:
            for sample in samples:
                payload = sample.to_task_payload()
                sample_id = payload.pop("sample_id")
                self.app.send_task(
                    GENERATE_TASK,
                    kwargs={"dataset": dataset, "sample_id": sample_id, "sample": payload},
                    queue=QUEUE_NAME,
                    producer=producer,
                    # What Flower shows and searches (it parses this repr as a dict): the dataset and the
                    # sample, not the prompt. Celery's own repr of the kwargs cuts a long prompt at 1,024
                    # characters, which Flower can no longer parse, and costs a saferepr per task.
                    argsrepr="()",
                    kwargsrepr=repr({"dataset": dataset, "sample_id": sample_id}),
                    stamped_headers=[DATASET_STAMP],
                    headers={SAMPLE_ID_HEADER: sample_id},
                    **{DATASET_STAMP: dataset},
                )
