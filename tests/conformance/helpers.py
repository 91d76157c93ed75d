"""Plain helpers of the conformance suite: configs, sources, submit in a process of its own, exports, and
the checks of records against the server's own request log."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import orjson

from budget import Ledger
from tests.conformance.real_server import VOCAB_SIZE, RequestRecord
from tests.support.files import read_jsonl, toml_value, write_jsonl
from tokenfleet.export import export_dataset

#: Where workers and submit find the ``--api-key`` server's keys (``[server] api_key_env``).
API_KEY_ENV: Final = "TOKENFLEET_CONFORMANCE_API_KEY"
ADMIN_KEY_ENV: Final = "TOKENFLEET_CONFORMANCE_ADMIN_KEY"
#: The first ids of the tiny model's vocabulary are its special tokens; prompts use the others.
FIRST_PLAIN_ID: Final = 3
SUBMIT_TIMEOUT_S: Final = 180.0


def token_rows(n: int, seed: int, prefix: str = "p") -> list[dict[str, Any]]:
    """``n`` pre-tokenized prompts of 8 to 40 ids, all inside the model's vocabulary."""
    span = VOCAB_SIZE - FIRST_PLAIN_ID
    return [
        {
            "id": f"{prefix}-{i}",
            "input_ids": [
                FIRST_PLAIN_ID + (seed * 7919 + i * 131 + j * 17) % span for j in range(8 + i % 33)
            ],
            "n": i,
        }
        for i in range(n)
    ]


def write_fleet_config(
    folder: Path,
    *,
    redis_url: str,
    server: str,
    datasets: Sequence[Mapping[str, Any]],
    sampling: Mapping[str, Any],
    server_options: Mapping[str, Any] | None = None,
) -> Path:
    """A TOML config for one server; each dataset has name, rows (written to data/NAME.jsonl, or ``raw``
    lines written as they are) and any other dataset key, ``sampling`` included."""
    lines = [f"redis_url = {toml_value(redis_url)}", 'output_dir = "out"', "", "[server]"]
    lines += [f"urls = {toml_value([server])}", "timeout_s = 120"]
    lines += [f"{k} = {toml_value(v)}" for k, v in (server_options or {}).items()]
    lines += ["", "[sampling]"] + [f"{k} = {toml_value(v)}" for k, v in sampling.items()]
    for ds in datasets:
        ds = dict(ds)
        rows, raw, ds_sampling = ds.pop("rows", None), ds.pop("raw", None), ds.pop("sampling", None)
        path = folder / "data" / f"{ds['name']}.jsonl"
        if rows is not None:
            write_jsonl(path, rows)
        if raw is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"".join(line + b"\n" for line in raw))
        ds.setdefault("path", f"data/{ds['name']}.jsonl")
        lines += ["", "[[dataset]]"] + [f"{k} = {toml_value(v)}" for k, v in ds.items()]
        if ds_sampling:
            lines += ["[dataset.sampling]"] + [f"{k} = {toml_value(v)}" for k, v in ds_sampling.items()]
    path = folder / "tokenfleet.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def cli_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    return dict(os.environ) | dict(extra or {})


class Submit:
    """``tokenfleet submit CONFIG`` in a process of its own, its output kept in a log file."""

    def __init__(self, config: Path, *extra: str, env: Mapping[str, str] | None = None) -> None:
        self.log = config.parent / f"submit-{time.time_ns()}.log"
        argv = [sys.executable, "-m", "tokenfleet.cli", "submit", str(config), *extra]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=cli_env(env))

    def wait(self, timeout_s: float = SUBMIT_TIMEOUT_S) -> int:
        """The exit code; a submit still running after ``timeout_s`` is killed and fails the test."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"submit did not settle in {timeout_s} s: {self.output()[-2000:]}") from None

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def run_cli(*argv: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenfleet.cli", *argv],
        capture_output=True,
        text=True,
        env=cli_env(env),
        timeout=60,
        check=False,
    )


def export_records(ledger: Ledger, name: str, folder: Path) -> list[dict[str, Any]]:
    report = export_dataset(ledger, name, folder / "exports" / f"{name}.jsonl")
    assert report.missing == 0, f"{report.missing} committed samples of {name} have no record"
    return read_jsonl(report.path)


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


@dataclass(frozen=True)
class ServerKeys:
    """The keys of the ``--api-key`` server, made fresh for each run."""

    api_key: str
    admin_api_key: str


@dataclass
class Workers:
    """The suite's worker processes and the folder of their logs."""

    procs: list[subprocess.Popen[bytes]]
    logs: Path


@dataclass(frozen=True)
class Mismatch:
    id: str
    problem: str


def served_output(
    record: Mapping[str, Any],
    served: Mapping[str, RequestRecord],
    by_prompt: Mapping[tuple[int, ...], RequestRecord],
) -> tuple[list[int] | None, int]:
    """The output ids the server returned for ``record``'s generation, and the requests it took: its rid's
    output, followed by each continuation's (workers/continuation.py: a request whose prompt is the record's
    prompt and every token the server returned before it), until the record's length."""
    seen = served.get(str(record.get("rid")))
    if seen is None or seen.output_ids is None:
        return None, 0
    out, requests = list(seen.output_ids), 1
    while len(out) < len(record["output_ids"]):
        nxt = by_prompt.get(tuple(record["input_ids"]) + tuple(out))
        if nxt is None or not nxt.output_ids:
            break
        out += nxt.output_ids
        requests += 1
    return out, requests


def mismatches_with_server(
    records: Sequence[Mapping[str, Any]],
    served: Mapping[str, RequestRecord],
    sources: Mapping[str, Sequence[int]],
) -> list[Mismatch]:
    """Each record against the server's log of its rid (and of its continuations): the prompt ids the
    server received are the source's, and the output ids the server returned are the record's, all of
    them."""
    by_prompt = {tuple(r.input_ids): r for r in served.values() if r.input_ids and r.output_ids is not None}
    problems = []
    for r in records:
        seen = served.get(str(r.get("rid")))
        if seen is None:
            problems.append(Mismatch(r["id"], f"the server has no record of rid {r.get('rid')}"))
            continue
        if r["input_ids"] != list(sources[r["id"]]) or seen.input_ids != r["input_ids"]:
            problems.append(Mismatch(r["id"], "prompt ids differ from the source's or the server's"))
        out, _ = served_output(r, served, by_prompt)
        if out is None or out != r["output_ids"]:
            problems.append(Mismatch(r["id"], f"output ids {r['output_ids'][:8]}... vs {out}"))
        if r["completion_tokens"] != len(r["output_ids"]):
            problems.append(Mismatch(r["id"], "completion_tokens differs from the ids"))
    return problems


def oov_line(i: int) -> bytes:
    """A pre-tokenized line whose last id is the vocabulary size: one past the last valid id."""
    return orjson.dumps({"id": f"oov-{i}", "input_ids": [FIRST_PLAIN_ID + i, 50, 60, VOCAB_SIZE]})
