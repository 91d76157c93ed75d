"""Tokens per sample as a log-scale histogram (``budget/lengths.py``): the buckets are exact in integers,
and a percentile read from them is the nearest-rank percentile's bucket upper bound, at most the longest."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from budget.lengths import EMPTY_BUCKET, bucket_of, parse_histogram, percentile, upper_bound

#: A bucket's width: its upper bound over its lower edge.
STEP = 2 ** (1 / 4)


def histogram_of(lengths: list[int]) -> dict[int, int]:
    return dict(Counter(bucket_of(n) for n in lengths))


def nearest_rank(lengths: list[int], p: float) -> int:
    ordered = sorted(lengths)
    return ordered[math.ceil(p / 100 * len(ordered)) - 1]


def test_each_length_lies_within_its_buckets_bounds_and_no_bucket_spans_over_a_quarter_doubling() -> None:
    for n in [*range(1, 5000), 10**6, 10**7 + 1, 2**24 - 1, 2**24, 2**24 + 1]:
        b = bucket_of(n)
        assert upper_bound(b - 1) < n <= upper_bound(b), n
        # the bucket's upper bound overstates the length by less than 2^(1/4)
        assert upper_bound(b) < n * STEP, n


@pytest.mark.parametrize("k", range(0, 26))
def test_a_power_of_two_is_the_exact_upper_bound_of_its_bucket(k: int) -> None:
    assert bucket_of(2**k) == 4 * k
    assert upper_bound(4 * k) == 2**k
    assert bucket_of(2**k + 1) > 4 * k


@pytest.mark.parametrize("k", range(3, 26))
def test_past_8_tokens_one_more_than_a_power_of_two_is_in_the_next_bucket(k: int) -> None:
    # below 8 some buckets hold no integer at all (2^(1/4) and 2^(2/4) are both under 2)
    assert bucket_of(2**k + 1) == 4 * k + 1


def test_a_sample_of_no_token_has_a_bucket_of_its_own_with_bound_zero() -> None:
    assert bucket_of(0) == EMPTY_BUCKET
    assert upper_bound(EMPTY_BUCKET) == 0
    assert percentile({EMPTY_BUCKET: 3, bucket_of(5): 1}, 50) == 0


def test_percentiles_of_two_clusters_are_their_buckets_upper_bounds_capped_at_the_longest() -> None:
    lengths = [10] * 50 + [100] * 50
    hist = histogram_of(lengths)

    assert percentile(hist, 50) == upper_bound(bucket_of(10)) == 11
    assert percentile(hist, 51) == upper_bound(bucket_of(100)) == 107
    assert percentile(hist, 95, cap=100) == 100  # never above the longest sample
    assert percentile(hist, 100, cap=100) == 100


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("p", [1, 25, 50, 90, 95, 99, 100])
def test_a_percentile_is_at_least_the_true_one_and_less_than_a_quarter_doubling_above_it(
    seed: int, p: float
) -> None:
    rng = random.Random(seed)
    lengths = [max(0, round(rng.lognormvariate(6, 1.2))) for _ in range(rng.randrange(1, 3000))]
    true = nearest_rank(lengths, p)

    reported = percentile(histogram_of(lengths), p, cap=max(lengths))

    assert reported is not None
    assert true <= reported <= max(lengths)
    assert reported < max(true, 1) * STEP


def test_no_sample_has_no_percentile_and_a_percentile_outside_0_100_is_refused() -> None:
    assert percentile({}, 50) is None
    assert percentile({4: 0}, 50) is None
    with pytest.raises(ValueError, match="within"):
        percentile({4: 1}, 0)
    with pytest.raises(ValueError, match="within"):
        percentile({4: 1}, 101)


def test_a_flat_hgetall_reply_parses_to_buckets_and_counts() -> None:
    assert parse_histogram(["-1", "2", "40", "7"]) == {-1: 2, 40: 7}
    assert parse_histogram([]) == {}
    assert parse_histogram(None) == {}
