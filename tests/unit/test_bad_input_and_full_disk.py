"""Pure pieces of issue 29: the URL the password check asks Redis with, ids beyond every vocabulary, and
what submit says of a dataset whose samples are held for room on the output disk."""

from __future__ import annotations

from budget import DatasetSnapshot
from producer.feeder import left_line
from producer.source import RecordReader, Rejected, beyond_every_vocabulary
from tokenfleet.redis_check import without_credentials


def test_the_url_without_credentials_keeps_host_port_database_and_tls_options() -> None:
    url = "rediss://user:pa%40ss@redis.internal:6380/3?ssl_cert_reqs=required&password=x"
    assert without_credentials(url) == "rediss://redis.internal:6380/3?ssl_cert_reqs=required"
    assert without_credentials("redis://:secret@[::1]:6379/0") == "redis://[::1]:6379/0"


def test_an_id_at_2_to_the_31_or_beyond_is_beyond_every_vocabulary_and_below_it_is_not() -> None:
    assert beyond_every_vocabulary([0, 2**31 - 1]) is None
    assert beyond_every_vocabulary([5, 2**63 - 1]) == (
        "input_ids[1] = 9223372036854775807 is beyond every known model's vocabulary (ids below 2^31); "
        "a real SGLang server crashes on it"
    )


def test_a_reader_without_a_vocabulary_rejects_ids_beyond_every_model_and_counts_the_unchecked() -> None:
    reader = RecordReader()
    assert isinstance(reader.read(b'{"id": "a", "input_ids": [1, 9223372036854775807]}', 1), Rejected)
    assert not isinstance(reader.read(b'{"id": "b", "input_ids": [1, 2]}', 2), Rejected)
    assert reader.unchecked == 1


def test_a_dataset_with_held_samples_is_left_unsettled_saying_they_wait_for_room() -> None:
    snap = DatasetSnapshot(
        name="ds", state="active", token_budget=None, max_samples=None, on_budget="truncate", tokens=10,
        samples=3, truncated=0, live_tokens=5, discarded_tokens=0, wasted_tokens=0, reclaimed=0, failed=0,
        queued=0, inflight=2, pending=0, rejected=0, source_total=5, source_done=True,
        output_error="h:1: cannot write /out/ds: No space left on device", held=2, held_bytes=900,
    )  # fmt: skip
    assert not snap.settled
    line = left_line(snap)
    assert "2 in flight" in line and "2 held: generated, their records waiting for room" in line
    assert "No space left on device" in line
