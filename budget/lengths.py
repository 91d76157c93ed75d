"""Tokens per sample as a fixed log-scale histogram: the buckets, and percentiles read from them.

The ledger keeps, per dataset, how many committed samples fell in each bucket (``lengths_hash`` in
``budget/keys.py``, counted by ``budget/lua/commit.lua``). Bucket ``b`` (``b >= 0``) holds the samples of
``n`` completion tokens with ``2^((b-1)/4) < n <= 2^(b/4)``: four buckets per doubling, so a bucket's upper
bound is at most 19% (``2^(1/4)``) above any sample in it. Bucket ``-1`` holds samples of no token.

The bucket is computed here, in exact integer arithmetic (``n^4 <= 2^b``), and sent to the script with each
generation: Lua's numbers are doubles, and ``n^4`` is not exact in a double past ``n`` of about 9,700.

A percentile is the nearest rank (the smallest count with at least ``p`` percent of the samples at or
below it), reported as the upper bound of the bucket that holds that rank, and never above the largest
length a sample may have (the dataset's ``max_new_tokens``, when it has one): the true value lies in
``(upper / 2^(1/4), upper]``. No interpolation: a reported p95 of 1,448 says that at least 95% of the
samples have at most 1,448 tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final

#: The bucket of samples with no token.
EMPTY_BUCKET: Final = -1
#: Buckets per doubling of the length.
PER_DOUBLING: Final = 4


def bucket_of(tokens: int) -> int:
    """The bucket of a sample of ``tokens`` completion tokens: the least ``b`` with ``tokens^4 <= 2^b``."""
    if tokens <= 0:
        return EMPTY_BUCKET
    return (tokens**PER_DOUBLING - 1).bit_length()


def upper_bound(bucket: int) -> int:
    """The most tokens a sample in ``bucket`` has: ``floor(2^(bucket/4))`` (0 for the empty bucket)."""
    if bucket < 0:
        return 0
    return math.isqrt(math.isqrt(1 << bucket))


def percentile(histogram: Mapping[int, int], p: float, cap: int | None = None) -> int | None:
    """The ``p``-th percentile (0 < p <= 100) of the lengths ``histogram`` counts (bucket -> samples), as
    its bucket's upper bound, at most ``cap``; None when it counts no sample."""
    if not 0 < p <= 100:
        raise ValueError(f"a percentile is within (0, 100], not {p}")
    total = sum(n for n in histogram.values() if n > 0)
    if total == 0:
        return None
    rank = math.ceil(p / 100 * total)
    seen = 0
    for bucket in sorted(histogram):
        count = histogram[bucket]
        if count <= 0:
            continue
        seen += count
        if seen >= rank:
            bound = upper_bound(bucket)
            return min(bound, cap) if cap else bound
    raise AssertionError("unreachable: the ranks add up to the total")  # pragma: no cover


def parse_histogram(flat: list[str] | list[bytes] | None) -> dict[int, int]:
    """The histogram from a flat HGETALL reply (``[bucket, count, ...]``)."""
    if not flat:
        return {}
    return {int(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}
