"""Publishing generate tasks to the Celery queue (the producer's side of ``workers.app``)."""

from __future__ import annotations

import contextlib
import math
import threading
import time
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

#: Samples per message at most: a worker process's default task threads (32) at this size hold its
#: generation threads' worth (``workers.tasks.GENERATION_THREADS``, 4,096). The sizer reaches it only
#: where few task threads hold many slots. Until 2026-12-07 it was 32, and a default worker on two cores
#: (64 task threads) held twice, not three times, a 1,024-slot server's cap: after the first answers the
#: server ran 630-900 of its 1,024 (docs/scaling.md).
MAX_GROUP: Final = 128
#: The task threads online hold about this many times the generations the servers run at once: a task
#: ends with its longest sample, and the slots its other samples gave back go to samples of other tasks
#: waiting for one, so the servers stay full while tasks wait for their stragglers (lognormal answers of
#: sigma 0.5: the longest of 32 is about 2.5 times the mean).
SPARE_FACTOR: Final = 3
#: Messages per server batch when no worker is online to count task threads (a message's cost is shared
#: by its samples) ...
GROUPS_PER_BATCH: Final = 8
#: ... of at most this many samples: the first messages, sent before a worker's heartbeat is counted, spread
#: over the task threads that come (at 1,024 slots, 32 messages rather than 8 of ``MAX_GROUP``).
FIRST_GROUP_MAX: Final = 32
#: How often the sizer counts the task threads online (the workers' heartbeats).
THREADS_EVERY_S: Final = 5.0
#: Messages a dataset's answers may cost per second before its groups grow: a message costs its worker
#: about 3 ms of CPU (Celery's receive, events, ack, and one admission call), against about 1.5 ms per
#: sample (measured with 7-token answers at 64 in flight, 2026-12-05: 2.45 ms of worker CPU a sample in
#: groups of 3, 1.86 in groups of 8, 1.64 in groups of 16). With short answers the servers' caps alone
#: gave groups of 3 and the fleet ran 0.73x the plain client's tokens/s; sized for at most this many
#: messages a second it runs at its speed.
TASKS_PER_S: Final = 40.0


def group_size(wanted_inflight: int | None, task_threads: int = 0) -> int:
    """Samples per message for servers that run ``wanted_inflight`` generations at once (the sum of their
    caps; None: unknown, taken as 256) and ``task_threads`` online (0: unknown)."""
    wanted = wanted_inflight or 256
    if task_threads > 0:
        k = math.ceil(SPARE_FACTOR * wanted / task_threads)
    else:
        k = min(FIRST_GROUP_MAX, math.ceil(wanted / GROUPS_PER_BATCH))
    return max(1, min(MAX_GROUP, k))


def group_for_rate(samples_per_s: float) -> int:
    """The least group that keeps a dataset answering ``samples_per_s`` within ``TASKS_PER_S`` messages a
    second (a power of two, so a rate that wavers does not change it every round), at most MAX_GROUP."""
    need = samples_per_s / TASKS_PER_S
    if need <= 1:
        return 1
    return min(MAX_GROUP, 2 ** math.ceil(math.log2(need)))


class GroupSizer:
    """``samples_per_task = "auto"``: each dataset's messages are sized from its servers' caps and the
    task threads online, so nobody has to choose a group size; it says what it chose."""

    def __init__(
        self,
        wanted_inflight: dict[str, int | None],
        say: Callable[[str], None] = lambda _: None,
        task_threads: Callable[[], int] = lambda: 0,
        rate: Callable[[str], float] = lambda _: 0.0,
    ) -> None:
        self._wanted = wanted_inflight
        self._say = say
        self._task_threads = task_threads
        self._rate = rate
        self._lock = threading.Lock()
        self._chosen: dict[str, int] = {}
        #: Per dataset, the largest group its answers' rate has asked for (never shrinks: the rate falls
        #: at a dataset's end, and a group size that came and went would say so every round).
        self._by_rate: dict[str, int] = {}
        self._threads = 0
        self._threads_at = -math.inf

    def threads(self) -> int:
        """The task threads online, counted at most every ``THREADS_EVERY_S``."""
        now = time.monotonic()
        if now - self._threads_at >= THREADS_EVERY_S:
            self._threads_at = now
            # a failed count keeps the last one: the size only needs to be about right
            with contextlib.suppress(Exception):
                self._threads = self._task_threads()
        return self._threads

    def __call__(self, dataset: str) -> int:
        wanted = self._wanted.get(dataset)
        threads = self.threads()
        k = group_size(wanted, threads)
        rate = self._rate(dataset)
        with self._lock:
            by_rate = max(self._by_rate.get(dataset, 1), group_for_rate(rate))
            self._by_rate[dataset] = by_rate
            k = max(k, by_rate)
            if self._chosen.get(dataset) == k:
                return k
            self._chosen[dataset] = k
        shown = f"{wanted:,}" if wanted else "unknown (taken as 256)"
        online = f", {threads} task threads online" if threads else ""
        fast = f"; {rate:,.0f} answers/s" if by_rate > 1 and k == by_rate else ""
        short = ""
        if wanted and threads and k * threads < SPARE_FACTOR * wanted:
            short = (
                f"; at most {MAX_GROUP} a task, so the workers hold {k * threads / wanted:.1f} samples per "
                f"slot, not {SPARE_FACTOR}: more worker processes would keep the servers fuller"
            )
        self._say(
            f"{dataset}: {k} sample(s) per task ({shown} generations at once on its servers{online}{fast}"
            f"{short})"
        )
        return k


class TaskPublisher:
    """Sends the samples as tasks: one task per sample, or per group of ``samples_per_task`` samples
    (the Celery cost of a message is shared by the group; a worker runs its samples at once, each
    leased and committed on its own, and the task ends when all are recorded).

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
