"""Stopping every in-flight generation of a dataset at once.

Our rids start with the dataset's tag (``workers.rids``) and SGLang's ``/abort_request`` matches by prefix,
so one call per server aborts all of the dataset's running and waiting requests there. Behind an
sglang-router, which does not proxy ``/abort_request``, each worker closing its stream is what aborts them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Final

from workers.rids import dataset_tag
from workers.sglang.client import SGLangClient

#: A worker process asks servers to abort a dataset at most this often (every stopped stream would
#: otherwise send its own).
MIN_INTERVAL_S: Final = 1.0


def abort_dataset(client: SGLangClient, dataset: str, servers: Sequence[str]) -> None:
    for server in servers:
        client.abort(server, dataset_tag(dataset))


class DatasetAborter:
    """Per-process, rate-limited ``abort_dataset``."""

    def __init__(self, client: SGLangClient, min_interval_s: float = MIN_INTERVAL_S) -> None:
        self._client = client
        self._min_interval_s = min_interval_s
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def __call__(self, dataset: str, servers: Sequence[str]) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(dataset, -self._min_interval_s) < self._min_interval_s:
                return
            self._last[dataset] = now
        abort_dataset(self._client, dataset, servers)
