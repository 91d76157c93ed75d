"""``tokenfleet demo`` works where no Redis answers: it starts an embedded one and cleans up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.files import read_jsonl
from tokenfleet.processes import free_port, redis_answers

pytestmark = pytest.mark.integration


def test_the_demo_runs_end_to_end_with_an_embedded_redis_when_none_answers(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert not redis_answers(url)
    env = {k: v for k, v in os.environ.items() if k != "TOKENFLEET_REDIS_URL"}

    done = subprocess.run(
        [sys.executable, "-m", "tokenfleet.cli", "demo", "--workdir", str(tmp_path), "--redis-url", url],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )

    assert done.returncode == 0, done.stdout + done.stderr
    assert "starting an embedded one" in done.stdout
    budgeted = read_jsonl(tmp_path / "exports" / "demo_instructions.jsonl")
    capped = read_jsonl(tmp_path / "exports" / "demo_pretokenized.jsonl")
    assert 0 < len(budgeted) < 240  # stopped by its token budget before the end of the source
    assert sum(r["completion_tokens"] for r in budgeted) >= 12000
    assert len(capped) == 100  # exactly its sample cap
    assert len({r["id"] for r in capped}) == 100
    assert not redis_answers(url)  # the embedded Redis was stopped
