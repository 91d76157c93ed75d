"""Throughput of the fleet against the anchor: the simplest client that does the job.

The anchor is one asyncio process, httpx, a semaphore of N requests in flight against one server. The
fleet runs the same prompts with the same N through ``tokenfleet submit`` and real worker processes. Both
run on the simulator (a separate process), one after the other in the same run, repeated; the table
gives medians and the fleet/anchor ratio.

    python bench/throughput.py                       # long and short outputs, N = 64
    python bench/throughput.py --workload short --fleet-processes 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import httpx
import orjson
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (
    bench_redis,
    fleet_cpu_meter,
    machine,
    median,
    print_table,
    sim_process,
    worker_processes,
)
from budget import Ledger
from tests.support.files import write_config
from tokenfleet.config import load_config
from tokenfleet.submit import run_submit

WORKLOADS: dict[str, dict[str, Any]] = {
    # hundreds of tokens per answer
    "long": {
        "sim": {"output_len_mean": 300, "output_len_sigma": 0.5},
        "requests": 1200,
        "max_new_tokens": 2048,
    },
    # at most 8 tokens per answer (7 and EOS)
    "short": {"sim": {"fixed_output_len": 7}, "requests": 6000, "max_new_tokens": 8},
}


CPU_PREFIX = "cpu_ms_per_request: "


def per_request(cpu_s: dict[str, float], requests: int) -> dict[str, float]:
    return {CPU_PREFIX + name: seconds * 1000 / requests for name, seconds in cpu_s.items()}


def prompts(n: int, seed: int, vocab: int = 31003) -> list[list[int]]:
    """``n`` prompts of 32 ids in [3, vocab)."""
    return [[3 + (seed * 104729 + i * 7919 + j * 31) % (vocab - 3) for j in range(32)] for i in range(n)]


#: The plain client's rids start with this (8 characters, as the fleet's dataset tag).
PLAIN_RID_PREFIX: Final = "plain000"


async def anchor(
    url: str,
    rows: list[list[int]],
    inflight: int,
    max_new_tokens: int,
    out: Path,
    sampling: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """N requests in flight, each slot with its own httpx.AsyncClient: the fastest plain httpx setup we
    measured (one shared client tops out far lower, its connection pool being the bottleneck at 64
    connections), so the fleet is held to the strongest simple anchor."""
    tokens = 0
    results: list[bytes] = []
    clients: asyncio.Queue[httpx.AsyncClient] = asyncio.Queue()
    for _ in range(inflight):
        clients.put_nowait(httpx.AsyncClient(timeout=600))

    async def one(ids: list[int]) -> None:
        nonlocal tokens
        client = await clients.get()
        try:
            r = await client.post(
                url + "/generate",
                json={
                    "input_ids": ids,
                    # one prefix for all: the simulator keeps its counts by rid prefix
                    "rid": PLAIN_RID_PREFIX + uuid.uuid4().hex,
                    "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.7}
                    | dict(sampling or {}),
                },
            )
            body = r.json()
            tokens += body["meta_info"]["completion_tokens"]
            results.append(orjson.dumps({"input_ids": ids, "output_ids": body["output_ids"]}))
        finally:
            clients.put_nowait(client)

    started = time.monotonic()
    try:
        await asyncio.gather(*(one(ids) for ids in rows))
    finally:
        elapsed = time.monotonic() - started
        while not clients.empty():
            await clients.get_nowait().aclose()
    out.write_bytes(b"\n".join(results) + b"\n")
    return {
        "tokens_per_s": tokens / elapsed,
        "requests_per_s": len(rows) / elapsed,
        "elapsed_s": elapsed,
        "started_at": started,  # time.monotonic(), after its clients were made
    }


def fleet(
    url: str,
    redis_url: str,
    rows: list[list[int]],
    max_new_tokens: int,
    folder: Path,
    window: int,
    samples_per_task: int = 1,
) -> dict[str, float]:
    name = f"bench_{uuid.uuid4().hex[:8]}"
    config = write_config(
        folder,
        redis_url=redis_url,
        servers=[url],
        datasets=[{"name": name, "rows": [{"input_ids": r} for r in rows]}],
        sampling={"max_new_tokens": max_new_tokens, "temperature": 0.7},
    )
    extra = f'output_dir = "out"\nfsync = "never"\nsamples_per_task = {samples_per_task}'
    config.write_text(config.read_text().replace('output_dir = "out"', extra))
    cfg = load_config(config, env={})
    started = time.monotonic()
    with open(os.devnull, "w") as devnull:
        run_submit(cfg, Console(file=devnull), server_check=False, window=window)
    elapsed = time.monotonic() - started
    snap = Ledger.from_url(redis_url).snapshot(name)
    assert snap.samples == len(rows), snap
    return {
        "tokens_per_s": snap.tokens / elapsed,
        "requests_per_s": snap.samples / elapsed,
        "elapsed_s": elapsed,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both")
    p.add_argument("--inflight", type=int, default=64)
    p.add_argument("--fleet-processes", type=int, default=2, help="worker processes")
    p.add_argument(
        "--samples-per-task",
        type=int,
        default=1,
        help="samples per Celery message (threads: N / processes / this)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--step-time-s", type=float, default=0.01)
    p.add_argument("--window", type=int, default=256, help="the fleet's queue window")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    rows_out = []
    raw: dict[str, Any] = {}
    names = list(WORKLOADS) if args.workload == "both" else [args.workload]
    threads = max(1, args.inflight // (args.fleet_processes * args.samples_per_task))
    for workload in names:
        w = WORKLOADS[workload]
        with (
            tempfile.TemporaryDirectory() as tmp,
            bench_redis() as redis_url,
            sim_process(step_time_s=args.step_time_s, max_running_requests=512, **w["sim"]) as url,
            worker_processes(redis_url, args.fleet_processes, threads, Path(tmp) / "logs"),
        ):
            runs: dict[str, list[dict[str, float]]] = {"anchor": [], "fleet": []}
            meter = fleet_cpu_meter(redis_url)
            for i in range(args.repeats):
                rows = prompts(w["requests"], seed=100 + i)
                meter.start()
                runs["anchor"].append(
                    asyncio.run(
                        anchor(url, rows, args.inflight, w["max_new_tokens"], Path(tmp) / f"anchor{i}.jsonl")
                    )
                )
                runs["anchor"][-1] |= per_request(meter.stop(), len(rows))
                meter.start()
                runs["fleet"].append(
                    fleet(
                        url,
                        redis_url,
                        rows,
                        w["max_new_tokens"],
                        Path(tmp) / f"f{i}",
                        args.window,
                        args.samples_per_task,
                    )
                )
                runs["fleet"][-1] |= per_request(meter.stop(), len(rows))
                for who in ("anchor", "fleet"):
                    r = runs[who][-1]
                    tok, req = r["tokens_per_s"], r["requests_per_s"]
                    print(
                        f"  {workload} run {i + 1} {who}: {tok:,.0f} tok/s {req:,.0f} req/s", file=sys.stderr
                    )
        raw[workload] = runs
        for metric in ("tokens_per_s", "requests_per_s"):
            a = median([r[metric] for r in runs["anchor"]])
            f = median([r[metric] for r in runs["fleet"]])
            ratios = [fr[metric] / ar[metric] for fr, ar in zip(runs["fleet"], runs["anchor"], strict=True)]
            rows_out.append(
                [
                    workload,
                    metric.replace("_per_s", "/s"),
                    f"{a:,.0f}",
                    f"{f:,.0f}",
                    f"{f / a:.3f}",
                    f"{median(ratios):.3f}",
                ]
            )
    cpu_rows = [
        [workload, key.removeprefix(CPU_PREFIX)]
        + [f"{median([r[key] for r in raw[workload][who]]):.3f}" for who in ("anchor", "fleet")]
        for workload in names
        for key in raw[workload]["anchor"][0]
        if key.startswith(CPU_PREFIX)
    ]
    print(
        f"\nmachine: {machine()}; N = {args.inflight} in flight; fleet: {args.fleet_processes} worker "
        f"processes x {threads} threads x {args.samples_per_task} samples per task; "
        f"simulator step {args.step_time_s * 1000:.0f} ms; "
        f"medians of {args.repeats} runs\n"
    )
    headers = ["workload", "metric", "anchor", "fleet", "ratio of medians", "median of paired ratios"]
    print_table(headers, rows_out)
    print("\nCPU per request (ms; medians), by process, while each side ran:\n")
    print_table(["workload", "process", "anchor run", "fleet run"], cpu_rows)
    if args.json:
        args.json.write_text(json.dumps({"headers": headers, "rows": rows_out, "raw": raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
