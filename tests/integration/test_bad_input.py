"""A messy source: every bad line is rejected with its line and reason into the dataset's rejected file
and counted in status; the rest of the dataset proceeds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from budget import Ledger
from tests.support.files import read_jsonl, unique, write_config
from tests.support.fleet import Sim, export
from tokenfleet.cli import main

pytestmark = pytest.mark.integration

HUGE_LINE_BYTES = 100 * 2**20  # a 100 MB line


def test_every_kind_of_bad_line_is_rejected_with_its_line_and_reason_and_the_rest_proceeds(
    workers: Any,
    fleet_redis_url: str,
    fleet_ledger: Ledger,
    sim_factory: Callable[..., Sim],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    sim = sim_factory(context_length=64)
    name = unique("messy")
    good = [orjson.dumps({"id": f"good-{i}", "text": f"prompt {i}"}) for i in range(5)]
    lines: list[tuple[bytes, str | None]] = [(g, None) for g in good]
    lines += [
        (b'{"text": "no id: one is derived from the content"}', None),
        (b'{"id": "bad-json", "text": "unterminated', "invalid JSON"),
        (b'{"id": "good-1", "text": "the same id again"}', 'duplicate id "good-1"'),
        (b'{"id": "wrong-type", "input_ids": "not a list"}', '"input_ids" must be'),
        (b'{"id": "empty", "text": ""}', '"text" must be a non-empty string'),
        (orjson.dumps({"id": "too-long", "input_ids": [5] * 100}), "prompt too long"),
        (b'{"id": "bad-utf8", "text": "\xff\xfe"}', "invalid UTF-8"),
        (b"[1, 2, 3]", "not a JSON object"),
        (b'{"id": "huge", "text": "' + b"a" * HUGE_LINE_BYTES + b'"}', "longer than the 16 MiB"),
        (b'{"id": "wrong-id", "text": "x", "id_extra": 1, "id": [1]}', '"id" must be'),
    ]
    source = tmp_path / "data" / f"{name}.jsonl"
    source.parent.mkdir(parents=True)
    source.write_bytes(b"\n".join(line for line, _ in lines) + b"\n")
    config = write_config(
        tmp_path,
        redis_url=fleet_redis_url,
        servers=[sim.url],
        datasets=[{"name": name, "path": f"data/{name}.jsonl"}],
        sampling={"max_new_tokens": 16},
    )

    assert main(["submit", str(config)]) == 0

    expected = {no: why for no, (_, why) in enumerate(lines, 1) if why is not None}
    rejected = {r["line"]: r for r in read_jsonl(tmp_path / "out" / name / "rejected.jsonl")}
    assert set(rejected) == set(expected)
    for line_no, why in expected.items():
        assert why in rejected[line_no]["reason"], (line_no, rejected[line_no])
    assert all(len(r["raw"]) <= 200 for r in rejected.values())  # the huge line is not copied

    snap = fleet_ledger.snapshot(name)
    records = export(fleet_ledger, name, tmp_path)
    assert snap.rejected == len(expected) and snap.failed == 0
    assert snap.samples == len(records) == 6 and snap.source_total == 6
    assert {r["id"] for r in records} >= {f"good-{i}" for i in range(5)}
    assert sim.stats()["requests"] == 6 + 1  # the good lines and the submit's probe: nothing bad was sent

    capsys.readouterr()
    assert main(["status", "--json", "--redis-url", fleet_redis_url, name]) == 0
    figures = orjson.loads(capsys.readouterr().out)["datasets"][0]
    assert figures["rejected"] == len(expected) and figures["unfed"] == 0
