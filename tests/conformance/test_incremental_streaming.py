"""The fleet against a real SGLang server run with ``--incremental-streaming-output``: each streamed chunk
carries only the new ``output_ids``. The records must still hold every id the server generated, in order,
whether the dataset sets its own ``stream_interval`` (many chunks) or leaves it to the worker's pacing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from budget import Ledger
from tests.conformance.helpers import (
    Submit,
    Workers,
    export_records,
    token_rows,
    write_fleet_config,
)
from tests.conformance.real_server import RealServer
from workers.rids import dataset_tag

pytestmark = [pytest.mark.conformance, pytest.mark.timeout(300)]


def test_a_server_streaming_deltas_gives_records_with_every_id_it_generated(
    conformance_workers: Workers,
    fleet_ledger: Ledger,
    fleet_redis_url: str,
    incremental_server: RealServer,
    dataset_name: Any,
    tmp_path: Path,
) -> None:
    chunked, paced = dataset_name("delta_chunks"), dataset_name("delta_paced")
    rows = {chunked: token_rows(40, seed=21), paced: token_rows(40, seed=22)}
    config = write_fleet_config(
        tmp_path,
        redis_url=fleet_redis_url,
        server=incremental_server.url,
        datasets=[
            # A chunk every 4 tokens: a 96-token output arrives in 25 deltas.
            {"name": chunked, "rows": rows[chunked], "sampling": {"stream_interval": 4}},
            {"name": paced, "rows": rows[paced]},
        ],
        sampling={"max_new_tokens": 96, "temperature": 0, "ignore_eos": True},
        # One generation at a time on the server, so each runs alone as the reference below does. The
        # server's greedy output depends on the batch it runs in: with 40 of these prompts sent at once
        # by a plain client (no fleet), 2 of 40 outputs differed from the same prompts sent alone, from
        # token 90 on (a near tie in the tiny random model's logits); sent alone, streamed in deltas
        # and not streamed gave the same ids for all 40.
        server_options={"max_inflight_per_server": 1},
    )

    assert Submit(config, "--window", "64").wait() == 0

    for name, source in rows.items():
        snap = fleet_ledger.snapshot(name)
        records = export_records(fleet_ledger, name, tmp_path)
        assert snap.samples == len(records) == len(source) and snap.failed == 0
        assert all(len(r["output_ids"]) == 96 for r in records)
        assert snap.tokens == 96 * len(source)
        served = incremental_server.requests(dataset_tag(name))
        # The server's request log holds the last chunk only (a delta): it must end each record.
        tails = [
            r["id"]
            for r in records
            if (seen := served.get(r["rid"])) is None
            or not seen.output_ids
            or r["output_ids"][-len(seen.output_ids) :] != seen.output_ids
            or seen.input_ids != r["input_ids"]
        ]
        assert tails == []
        # Greedy, alone on the server: the same prompt, not streamed, gives the whole output to compare with.
        whole = {
            r["id"]: incremental_server.generate(
                r["input_ids"], {"max_new_tokens": 96, "temperature": 0, "ignore_eos": True}
            )
            for r in records
        }
        differ = [r["id"] for r in records if r["output_ids"] != whole[r["id"]]]
        assert differ == [], f"{len(differ)} of {len(records)} records differ from the server's whole output"
