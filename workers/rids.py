"""Request ids sent to SGLang.

A real SGLang server aborts only an exact, live rid, and then also every live rid that starts with it: so
every rid has the same length and none is a prefix of another. An rid is an 8-hex-digit tag of the dataset,
then ``uuid4().hex``: the tag lets a server's own request log (and the simulator) count tokens per
dataset. Stopping a dataset aborts each of its requests by its own rid (``workers/stops.py``).
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Final

TAG_LENGTH: Final = 8
RID_LENGTH: Final = TAG_LENGTH + 32


def dataset_tag(dataset: str) -> str:
    return hashlib.sha1(dataset.encode()).hexdigest()[:TAG_LENGTH]


def new_rid(dataset: str) -> str:
    return dataset_tag(dataset) + uuid.uuid4().hex
