"""A million prompts: producer memory, Redis memory per done sample, enqueue rate, status latency, export
rate. Runs against a Redis database of its own (``TOKENFLEET_BENCH_REDIS_URL``, default db 12).

    python bench/million.py               # 1,000,000 lines
    python bench/million.py --lines 200000

What each figure is:
- enqueue: the producer feeding a fresh dataset with a window as large as the run, no worker consuming:
  tasks published per second (ledger check + Celery publish), and the producer's peak RSS over the pass.
- resume pass: the whole source read again with every sample already done (a rerun of submit): lines per
  second and peak RSS; nothing is published.
- Redis: bytes per done sample (MEMORY USAGE of the done hash / its length) and the queue window's bytes.
- status: wall time of ``tokenfleet status --json`` (a new process) with the million-sample done-set.
- export: records per second writing the million committed records once.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import bench_redis, machine, print_table
from budget import DatasetLimits, Ledger
from producer.feeder import DatasetFeed, Feeder
from tokenfleet.export import export_dataset
from tokenfleet.publish import TaskPublisher
from workers.app import make_app
from workers.messages import QUEUE_NAME


def peak_rss_mib() -> float:
    """This process's peak RSS so far (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_source(path: Path, lines: int) -> None:
    with path.open("wb") as f:
        for i in range(lines):
            f.write(
                orjson.dumps({"id": f"s{i:07d}", "input_ids": [3 + (i * 7 + j) % 30000 for j in range(24)]})
            )
            f.write(b"\n")


def write_parts(folder: Path, done: dict[str, str]) -> None:
    """Part files as workers write them: a record per committed sample, in two files."""
    folder.mkdir(parents=True, exist_ok=True)
    files = [(folder / f"part-bench-{k}.jsonl").open("wb") for k in range(2)]
    for i, (sid, attempt) in enumerate(done.items()):
        record = {
            "id": sid,
            "dataset": "m",
            "input_ids": [5] * 24,
            "output_ids": [7] * 64,
            "text": "x" * 64,
            "finish_reason": {"type": "stop", "matched": 2},
            "prompt_tokens": 24,
            "completion_tokens": 64,
            "truncated": False,
            "meta": {},
            "attempt": attempt,
        }
        files[i % 2].write(orjson.dumps(record) + b"\n")
    for f in files:
        f.close()


def resume_pass(url: str, name: str, source: str, tmpdir: str) -> tuple[float, float]:
    """A whole pass over the source with every sample done (a rerun of submit): seconds, peak RSS (MiB)."""
    ledger = Ledger.from_url(url)
    feed = DatasetFeed(name, Path(source), Path(tmpdir) / "out" / name / "rejected.jsonl")
    feeder = Feeder(ledger, TaskPublisher(make_app(url)), [feed], window=512, queue_key=QUEUE_NAME)
    t = time.monotonic()
    feed.start_pass()
    feeder._feed(feed, 512)  # done samples take no room: the whole source is read
    return time.monotonic() - t, peak_rss_mib()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lines", type=int, default=1_000_000)
    p.add_argument("--enqueue", type=int, default=100_000, help="tasks published in the enqueue measurement")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    rows: list[list[Any]] = []
    with tempfile.TemporaryDirectory() as tmp, bench_redis() as url:
        tmpdir = Path(tmp)
        source = tmpdir / "million.jsonl"
        t = time.monotonic()
        write_source(source, args.lines)
        size_mib = source.stat().st_size / 2**20
        took = time.monotonic() - t
        print(f"wrote {args.lines:,} lines ({size_mib:.0f} MiB) in {took:.1f} s", file=sys.stderr)
        ledger = Ledger.from_url(url)
        app = make_app(url)

        # 1. enqueue: a fresh dataset, a window as large as the measurement, no worker consuming.
        name = "enqueue"
        ledger.register(name, DatasetLimits(), {"servers": [], "output_dir": str(tmpdir / "out")})
        feed = DatasetFeed(name, source, tmpdir / "out" / name / "rejected.jsonl")
        feeder = Feeder(ledger, TaskPublisher(app), [feed], window=args.enqueue, queue_key=QUEUE_NAME)
        t = time.monotonic()
        feed.start_pass()
        feeder._feed(feed, args.enqueue)  # one call fills the window: exactly args.enqueue tasks
        enqueue_s = time.monotonic() - t
        queued = ledger.snapshot(name).queued
        queue_bytes = ledger.client.memory_usage(QUEUE_NAME) or 0
        rows.append(
            [
                "enqueue (publish, window full)",
                f"{queued / enqueue_s:,.0f} tasks/s",
                f"{queued:,} tasks in {enqueue_s:.1f} s",
            ]
        )
        rows.append(
            [
                "queue window in Redis",
                f"{queue_bytes / queued:,.0f} bytes/task",
                f"{queue_bytes / 2**20:.1f} MiB for {queued:,} queued tasks",
            ]
        )
        ledger.purge_queue(name, QUEUE_NAME, "bench")

        # 2. a million done samples: the done-set's memory, then a resume pass that skips all of them.
        name = "m"
        ledger.register(name, DatasetLimits(), {"servers": [], "output_dir": str(tmpdir / "out")})
        done = {f"s{i:07d}": uuid.uuid4().hex[:16] for i in range(args.lines)}
        ledger.rebuild(name, done, 64 * args.lines, 0, {})
        done_bytes = ledger.client.memory_usage(ledger.keys_of(name).done_hash) or 0
        rows.append(
            [
                "Redis: done-set",
                f"{done_bytes / args.lines:,.0f} bytes/done sample",
                f"{done_bytes / 2**20:.0f} MiB for {args.lines:,} samples",
            ]
        )
        # The producer in a process of its own, so its peak RSS is the producer's alone.
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            resume_s, rss = pool.apply(resume_pass, (url, name, str(source), str(tmpdir)))
        rows.append(
            [
                "resume pass (all done, nothing published)",
                f"{args.lines / resume_s:,.0f} lines/s",
                f"{args.lines:,} lines in {resume_s:.1f} s",
            ]
        )
        rows.append(
            [
                "producer peak RSS over the pass",
                f"{rss:,.0f} MiB",
                "a process of its own; includes the duplicate-id check (about 50 bytes a line)",
            ]
        )

        # 3. status with a million-sample done-set (a new process, as an operator runs it).
        timings = []
        for _ in range(3):
            t = time.monotonic()
            subprocess.run(
                [sys.executable, "-m", "tokenfleet.cli", "status", "--json", "--redis-url", url],
                check=True,
                stdout=subprocess.DEVNULL,
                env=dict(os.environ),
            )
            timings.append(time.monotonic() - t)
        rows.append(["status --json (new process)", f"{sorted(timings)[1]:.2f} s", "median of 3"])

        # 4. export a million committed records.
        write_parts(tmpdir / "out" / name, done)
        del done
        t = time.monotonic()
        report = export_dataset(ledger, name, tmpdir / "export.jsonl")
        export_s = time.monotonic() - t
        rows.append(
            [
                "export",
                f"{report.records / export_s:,.0f} records/s",
                f"{report.records:,} records in {export_s:.1f} s",
            ]
        )
        ledger.forget("m")
        ledger.forget("enqueue")
    print(f"\nmachine: {machine()}; {args.lines:,} lines\n")
    print_table(["what", "figure", "detail"], rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
