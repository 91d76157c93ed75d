"""A lease's live tokens as reported: counted from its stream's chunks, or at its speed between them."""

from __future__ import annotations

from workers.leases import Lease


def test_a_lease_without_a_pace_reports_what_its_chunks_counted() -> None:
    lease = Lease("ds", "s1", "a1", live=120)
    assert lease.reported(now=1e9) == 120


def test_a_paced_lease_reports_its_tokens_at_the_speed_of_its_server_between_chunks() -> None:
    lease = Lease("ds", "s1", "a1", live=30)
    lease.pace = (100.0, 50.0, 30, 4096)  # sent at 100 s with 30 tokens kept, 50 tokens/s
    assert lease.reported(now=100.0) == 30
    assert lease.reported(now=104.0) == 30 + 200
    lease.live = 400  # a chunk counted more than the estimate: the count wins
    assert lease.reported(now=104.0) == 400


def test_a_paced_lease_reports_at_most_its_requests_max_new_tokens() -> None:
    lease = Lease("ds", "s1", "a1", live=0)
    lease.pace = (0.0, 100.0, 0, 256)
    assert lease.reported(now=60.0) == 256
