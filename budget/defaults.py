"""Every default a dataset's generation runs with, declared once: the config (``tokenfleet.config``), the
dataset spec workers read (``budget.spec``), the runner and the SGLang client all import them from here.
"""

from __future__ import annotations

import re
from typing import Final

#: Seconds a generation may take in all before it is given up and retried.
TIMEOUT_S: Final = 1800.0
#: Seconds a stream may stay silent (before its first chunk, or between two) before it is given up as
#: stalled and the server marked down: a few times the longest normal gap (a long prefill on a busy server).
STALL_TIMEOUT_S: Final = 60.0
#: Attempts per sample against 5xx, dropped connections and server-side aborts, before a task gives up.
MAX_ATTEMPTS: Final = 5
#: Tasks that may give up on a sample (retries exhausted) before it is failed for good.
MAX_STRIKES: Final = 3
#: A task gives up on a sample only once its attempts span at least this long: its last attempt waits
#: for it. A server restarting for a few seconds then costs no strike, while a dead one still fails a
#: sample after ``MAX_STRIKES`` tasks (each at least this long, with no more requests than the attempts).
RETRY_MIN_SPAN_S: Final = 10.0
#: Exponential backoff with full jitter between attempts: a random wait in [0, min(cap, base * 2**n)].
BACKOFF_BASE_S: Final = 1.0
BACKOFF_CAP_S: Final = 30.0
#: What happens to generations in flight when the token budget is reached (docs/budgets.md).
ON_BUDGET: Final = "truncate"
#: "always": a record is on disk (fsync) before the ledger counts it; "never": in the page cache.
FSYNC: Final = "always"
#: When a dataset's sampling sets no ``stream_interval``, the worker picks one per request so that a
#: chunk comes about every quarter of the stall timeout at the speed a stream is expected to reach on the
#: server, given the streams this process has there (chunks then only prove the stream is alive:
#: budgets are kept by reservations, stops by aborts): at least this many tokens, and at most
#: ``max_new_tokens`` (``workers/stream_pacing.py``).
STREAM_INTERVAL_MIN: Final = 64
#: Which replies of a chat record are generated: "last" or "all" (docs/eagle3.md).
REGENERATE: Final = "last"
#: How long a generation's lease lives without renewal; a worker renews it every quarter.
LEASE_S: Final = 60.0
#: What a dataset name may be: it names a folder under the output dir, and a Redis hash tag.
DATASET_NAME_RE: Final = re.compile(r"[A-Za-z0-9_.-]+")
#: Input ids at or above this are beyond every known model's vocabulary (the largest have a few hundred
#: thousand ids): with the servers' vocabulary unknown, a line holding one is still rejected, never sent
#: (an id outside the vocabulary crashes a real SGLang server).
INPUT_ID_CEILING: Final = 2**31
