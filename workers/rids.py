"""Request ids sent to SGLang.

``/abort_request`` matches rids by prefix, so every rid has the same length and none is a prefix of
another: an 8-hex-digit tag of the dataset, then ``uuid4().hex``. The tag also lets one abort call reach
every request of a dataset on a server, and lets the simulator count tokens per dataset.
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
