"""Where a dataset is heading (``tokenfleet.status_view.project``): its final committed tokens from the
samples it will have at the mean length so far, capped by its budget, and the fleet time left at the
current token rate; and the figures ``status --json`` adds for them."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from budget import DatasetSnapshot, DatasetState
from budget.lengths import bucket_of
from tests.support.snapshots import server_status_of, snapshot_of
from tests.support.status import render
from tokenfleet.status_detail import dataset_detail
from tokenfleet.status_view import expected_samples, project, server_health, snapshot_json, status_table


def snap(**changes: Any) -> DatasetSnapshot:
    """A dataset with 5 queued and 2 in flight, then ``changes``."""
    return snapshot_of(**({"queued": 5, "inflight": 2} | changes))


def test_a_counted_source_without_budget_projects_its_samples_at_the_mean_length() -> None:
    # 100 source samples, 2 failed: 98 expected at 40 tokens each
    s = snap(tokens=1000, samples=25, failed=2, source_total=100, source_done=True, live_tokens=60)
    s = dataclasses.replace(s, tokens_per_s=200.0)

    p = project(s)

    assert expected_samples(s) == 98
    assert p.final_tokens == 98 * 40
    assert p.remaining_tokens == 98 * 40 - 1000 - 60
    assert p.remaining_s == pytest.approx((98 * 40 - 1060) / 200.0)


def test_a_budget_caps_the_projection_and_the_discarded_tokens_come_off_it() -> None:
    s = snap(tokens=1000, samples=25, source_total=1000, source_done=True, token_budget=5000)
    assert project(s).final_tokens == 5000

    s = dataclasses.replace(s, on_budget="discard", discarded_tokens=300)
    assert project(s).final_tokens == 4700


def test_until_the_source_is_counted_a_budget_or_a_sample_cap_is_what_tells() -> None:
    assert project(snap(tokens=1000, samples=25)).final_tokens is None
    assert project(snap(tokens=1000, samples=25, token_budget=8000)).final_tokens == 8000
    assert project(snap(tokens=1000, samples=25, max_samples=50)).final_tokens == 2000
    assert project(snap(tokens=1000, samples=25, max_samples=50, token_budget=1500)).final_tokens == 1500


def test_no_sample_yet_and_no_budget_projects_nothing_and_no_rate_gives_no_time() -> None:
    p = project(snap(source_total=10, source_done=True))
    assert (p.final_tokens, p.remaining_tokens, p.remaining_s) == (None, None, None)

    p = project(snap(tokens=100, samples=10, source_total=20, source_done=True))
    assert (p.final_tokens, p.remaining_tokens, p.remaining_s) == (200, 100, None)


def test_a_settled_or_revoked_dataset_ends_with_what_it_has() -> None:
    settled = snap(tokens=900, samples=30, source_total=40, source_done=True, queued=0, inflight=0)
    assert settled.settled
    assert (project(settled).final_tokens, project(settled).remaining_s) == (900, 0.0)
    revoked = snap(tokens=900, samples=30, state=DatasetState.REVOKED, token_budget=10_000)
    assert project(revoked).final_tokens == 900


def test_status_json_adds_reasoning_lengths_max_new_hits_and_the_projection() -> None:
    lengths = [10] * 50 + [100] * 50
    s = snap(
        tokens=sum(lengths),
        samples=len(lengths),
        source_total=200,
        source_done=True,
        reasoning_tokens=2000,
        hit_max_new=10,
        longest=100,
        lengths={bucket_of(10): 50, bucket_of(100): 50},
        tokens_per_s=100.0,
    )

    out = snapshot_json(s)

    assert out["reasoning_tokens"] == 2000
    assert out["answer_tokens"] == 5500 - 2000
    assert out["tokens_per_sample_mean"] == 55.0
    assert out["tokens_per_sample_p50"] == 11  # the upper bound of 10's bucket
    assert out["tokens_per_sample_p95"] == 100  # 107, capped at the longest sample
    assert out["longest_sample_tokens"] == 100
    assert out["hit_max_new"] == 10
    assert out["hit_max_new_share"] == 0.1
    assert out["projected_final_tokens"] == 200 * 55
    assert out["projected_remaining_tokens"] == 200 * 55 - 5500
    assert out["projected_remaining_s"] == 55.0
    # the first fields keep their order (additive only)
    assert list(out)[:10] == [
        "name",
        "state",
        "tokens",
        "token_budget",
        "samples",
        "max_samples",
        "failed",
        "dropped",
        "queued",
        "inflight",
    ]


def test_status_json_of_a_dataset_without_samples_says_none_for_per_sample_figures() -> None:
    out = snapshot_json(snap())
    assert out["tokens_per_sample_mean"] is None
    assert out["tokens_per_sample_p50"] is None
    assert out["tokens_per_sample_p95"] is None
    assert out["longest_sample_tokens"] is None
    assert out["hit_max_new_share"] is None
    assert out["reasoning_tokens"] == out["answer_tokens"] == 0


def test_a_budget_is_at_full_speed_until_the_answers_in_flight_are_expected_to_fill_what_is_left() -> None:
    # 40 tokens per answer so far; 2 in flight have produced 30 of the 80 they are expected to
    far = snap(tokens=1000, samples=25, token_budget=5000, live_tokens=30)
    near = snap(tokens=4800, samples=120, token_budget=5000, live_tokens=30, inflight=5)

    assert project(far).regime == "full speed"
    assert project(near).regime == "final stretch"  # 170 left, 5 x 40 - 30 = 170 expected
    assert project(dataclasses.replace(far, state=DatasetState.EXHAUSTED)).regime == "spent"
    assert project(snap(tokens=1000, samples=25)).regime is None
    assert snapshot_json(near)["budget_regime"] == "final stretch"


def test_the_eta_of_a_budget_that_keeps_whole_answers_adds_the_longest_answers_tail() -> None:
    lengths = {bucket_of(40): 90, bucket_of(400): 10}  # a p95 of about 400 tokens, a mean of 76
    base = snap(tokens=7600, samples=100, token_budget=20_000, inflight=10, lengths=lengths)
    base = dataclasses.replace(base, tokens_per_s=1000.0)  # 100 tokens/s per stream
    truncate, discard = project(base), project(dataclasses.replace(base, on_budget="discard"))

    assert truncate.eta_budget_s == pytest.approx((20_000 - 7600) / 1000.0)
    p95 = dataclasses.replace(base, on_budget="discard").tokens_per_sample_p95
    assert p95 is not None and p95 >= 400
    # the answers of p95 length still to finish, at one stream's speed, after the rate's own estimate
    assert discard.eta_budget_s == pytest.approx((20_000 - 7600) / 1000.0 + (p95 - 76) / 100.0)


@pytest.mark.parametrize("state", [DatasetState.PAUSED, DatasetState.REVOKED])
def test_a_paused_or_revoked_dataset_has_no_eta_whatever_rate_its_last_seconds_show(state: str) -> None:
    # it was generating a moment ago (a rate over the last 30 s), and still has samples queued or in flight
    moving = snap(tokens=1000, samples=25, token_budget=100_000, source_total=1000, source_done=True)
    moving = dataclasses.replace(moving, tokens_per_s=167.0, samples_per_s=4.0)
    halted = dataclasses.replace(moving, state=state)
    assert project(moving).eta_s is not None and not halted.settled

    p, out = project(halted), snapshot_json(halted)

    assert (p.eta_budget_s, p.eta_source_s, p.eta_s) == (None, None, None)
    assert (out["eta_budget_s"], out["eta_source_s"], out["eta_s"]) == (None, None, None)
    # paused: tokens are left to generate, in no known time; revoked: nothing is left to generate
    assert out["projected_remaining_s"] == (None if state == DatasetState.PAUSED else 0.0)


def test_the_table_and_the_detail_of_a_paused_dataset_show_no_eta() -> None:
    moving = snap(tokens=1000, samples=25, token_budget=100_000, source_total=1000, source_done=True)
    moving = dataclasses.replace(moving, tokens_per_s=167.0, samples_per_s=4.0)
    paused = dataclasses.replace(moving, state=DatasetState.PAUSED)
    eta = re.compile(r"\b\d+m\d\ds\b")  # 9m53s: the time the rate would give
    assert eta.search(render(status_table([moving]), 200))

    table = render(status_table([paused]), 200)
    detail = render(dataset_detail(paused, {}, {}, []), 120)

    assert not eta.search(table), table
    assert not eta.search(detail), detail
    assert "ETA by" not in detail


def test_a_servers_up_is_shown_with_its_age_once_nothing_confirmed_it_for_a_minute() -> None:
    assert server_health(server_status_of()).plain == "up"
    assert server_health(server_status_of(last_ok_s_ago=1800.0)).plain.startswith("up 30m")
    # in use: it is current
    assert server_health(server_status_of(last_ok_s_ago=1800.0, inflight=3)).plain == "up"
    assert server_health(server_status_of(up=False, last_ok_s_ago=1800.0)).plain == "down"
