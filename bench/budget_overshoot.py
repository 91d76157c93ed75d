"""How far past its token budget a dataset goes: the fleet's policies against a baseline client.

The baseline is the script of the story: one asyncio process, httpx, N requests in flight against one
server, that stops *issuing* once the tokens of finished requests reach the budget and lets in-flight
requests run to their end. The fleet runs the same prompts through real worker processes with
``on_budget`` = truncate, discard and drain. Everything runs on the simulator (lognormal output lengths),
one after the other in the same run; the simulator counts the tokens it generated for each dataset (rid
prefix), which is the GPU time spent.

    python bench/budget_overshoot.py                 # budgets 50k and 100k, 64 in flight
    python bench/budget_overshoot.py --budgets 20000 --repeats 1   # quicker
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
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import bench_redis, machine, median, print_table, sim_process, sim_stats, worker_processes
from budget import Ledger
from tests.support.files import write_config
from tokenfleet.config import load_config
from tokenfleet.submit import run_submit
from workers.rids import dataset_tag

MAX_NEW_TOKENS = 2048


def prompts(n: int, seed: int) -> list[list[int]]:
    return [[3 + (seed * 104729 + i * 7919 + j * 31) % 31000 for j in range(16)] for i in range(n)]


async def baseline(url: str, name: str, rows: list[list[int]], budget: int, inflight: int) -> dict[str, Any]:
    """Stop issuing at the budget; in-flight requests finish. Returns its counters."""
    counted = 0
    stop_at: float | None = None
    sem = asyncio.Semaphore(inflight)
    tag = dataset_tag(name)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=inflight)) as client:

        async def one(ids: list[int]) -> None:
            nonlocal counted, stop_at
            try:
                r = await client.post(
                    url + "/generate",
                    json={
                        "input_ids": ids,
                        "rid": tag + uuid.uuid4().hex,
                        "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.7},
                    },
                )
                counted += r.json()["meta_info"]["completion_tokens"]
                if counted >= budget and stop_at is None:
                    stop_at = time.monotonic()
            finally:
                sem.release()

        started = time.monotonic()
        tasks = []
        for ids in rows:
            await sem.acquire()
            if counted >= budget:
                sem.release()
                break
            tasks.append(asyncio.create_task(one(ids)))
        await asyncio.gather(*tasks)
        end = time.monotonic()
    return {"exported": counted, "wall_s": end - started, "after_stop_s": end - (stop_at or end)}


def fleet(
    url: str, redis_url: str, name: str, rows: list[list[int]], budget: int, policy: str, folder: Path
) -> dict[str, Any]:
    config = write_config(
        folder,
        redis_url=redis_url,
        servers=[url],
        datasets=[
            {
                "name": name,
                "rows": [{"input_ids": r} for r in rows],
                "token_budget": budget,
                "on_budget": policy,
            }
        ],
        sampling={"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.7},
    )
    ledger = Ledger.from_url(redis_url)
    started = time.monotonic()
    exhausted_at: list[float] = []

    def watch(snaps: Any) -> None:
        if not exhausted_at and any(s.state == "exhausted" for s in snaps):
            exhausted_at.append(time.monotonic())

    with open(os.devnull, "w") as devnull:
        run_submit(
            load_config(config, env={}), Console(file=devnull), server_check=False, window=128, observer=watch
        )
    end = time.monotonic()
    snap = ledger.snapshot(name)
    return {
        "exported": snap.tokens,
        "wall_s": end - started,
        "after_stop_s": end - (exhausted_at[0] if exhausted_at else end),
        "discarded": snap.discarded_tokens,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", type=int, nargs="+", default=[50_000, 100_000])
    p.add_argument("--inflight", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="runs per cell; medians are reported")
    p.add_argument("--step-time-s", type=float, default=0.01)
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()

    modes = ["baseline", "truncate", "discard", "drain"]
    results: dict[tuple[int, str], list[dict[str, Any]]] = {}
    workers_n, threads = 2, args.inflight // 2
    with (
        tempfile.TemporaryDirectory() as tmp,
        bench_redis() as redis_url,
        sim_process(
            step_time_s=args.step_time_s, output_len_mean=200, output_len_sigma=0.6, max_running_requests=512
        ) as url,
        worker_processes(redis_url, workers_n, threads, Path(tmp) / "logs"),
    ):
        seed = 0
        for budget in args.budgets:
            n = int(budget / 200 * 3)
            for _ in range(args.repeats):
                for mode in modes:
                    seed += 1
                    name = f"{mode}_{budget}_{seed}"
                    rows = prompts(n, seed)
                    if mode == "baseline":
                        r = asyncio.run(baseline(url, name, rows, budget, args.inflight))
                    else:
                        r = fleet(url, redis_url, name, rows, budget, mode, Path(tmp) / name)
                    r["generated"] = int(sim_stats(url)["by_prefix"].get(dataset_tag(name), 0))
                    results.setdefault((budget, mode), []).append(r)
                    g, e = r["generated"], r["exported"]
                    print(f"  {mode:9} budget {budget:>7,}: server {g:>7,} exported {e:>7,}", file=sys.stderr)

    rows_out = []
    headers = [
        "budget",
        "mode",
        "server tokens / budget",
        "exported / budget",
        "waste (% of budget)",
        "wall s",
        "after the stop s",
    ]
    for (budget, mode), runs in results.items():
        gen = median([r["generated"] for r in runs])
        exp = median([r["exported"] for r in runs])
        rows_out.append(
            [
                f"{budget:,}",
                mode if mode == "baseline" else f"fleet {mode}",
                f"{gen / budget:.3f}x",
                f"{exp / budget:.3f}x",
                f"{100 * (gen - exp) / budget:.1f}%",
                f"{median([r['wall_s'] for r in runs]):.1f}",
                f"{median([r['after_stop_s'] for r in runs]):.1f}",
            ]
        )
    print(
        f"\nmachine: {machine()}; {args.inflight} in flight "
        f"({workers_n} worker processes x {threads} threads); "
        f"lognormal outputs, mean 200 tokens; medians of {args.repeats} run(s)\n"
    )
    print_table(headers, rows_out)
    if args.json:
        args.json.write_text(json.dumps({"headers": headers, "rows": rows_out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
