"""A full output disk, as a new user meets it (issue 29): two worker processes, one dataset, the output
folder on a small real filesystem (a tmpfs, root only) left with a little free space; the job's own records
fill it, it stays full for a while, then the operator frees space by deleting a file.

    sudo .venv/bin/python -m bench.full_disk [--disk-kib 2048] [--free-kib 300] [--full-s 60]

Prints: the server tokens generated while the disk was full, the samples held and committed in that
window, the requests against the samples (a regenerated sample is a second request), the tokens generated
past what the export holds, and whether any line is torn.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from bench._common import bench_redis, machine, sim_process, sim_stats, worker_processes
from budget import Ledger
from tests.support.disks import fill
from tests.support.files import write_config
from tokenfleet.export import export_dataset
from workers.output_guard import room_problem, worst_record_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--disk-kib", type=int, default=2048)
    parser.add_argument("--free-kib", type=int, default=300)
    parser.add_argument("--full-s", type=float, default=60.0)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument(
        "--fill-after",
        type=int,
        default=0,
        help="instead: start with the disk free, and fill it to the last byte once this many are committed",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, bench_redis() as redis_url:
        root = Path(tmp)
        disk = root / "disk"
        disk.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={args.disk_kib}k", "tmpfs", str(disk)], check=True
        )
        try:
            run(root, disk, redis_url, args)
        finally:
            subprocess.run(["umount", "-l", str(disk)], check=False)


def run(root: Path, disk: Path, redis_url: str, args: argparse.Namespace) -> None:
    filler = disk / "filler.bin"
    st = os.statvfs(disk)
    if not args.fill_after:
        filler.write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - args.free_kib * 1024))
    name = "fulldisk"
    rows = [{"id": f"p-{i}", "text": f"prompt number {i}: explain something"} for i in range(args.samples)]
    with sim_process(step_time_s=0.01, output_len_mean=60.0) as url:
        config = write_config(
            root,
            redis_url=redis_url,
            servers=[url],
            datasets=[{"name": name, "rows": rows}],
            sampling={"max_new_tokens": 200},
        )
        config.write_text(config.read_text().replace('output_dir = "out"', f'output_dir = "{disk}"'))
        ledger = Ledger.from_url(redis_url)
        with worker_processes(redis_url, 2, 8, root / "logs"):
            argv = [sys.executable, "-m", "tokenfleet.cli", "submit", str(config), "--no-server-check"]
            log = (root / "submit.log").open("wb")
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
            # Full: not even one worst-case record (and the margin) fits any more.
            one_record = worst_record_bytes({"sample_id": "p-999", "text": rows[0]["text"]}, 200)
            if args.fill_after:
                while name not in ledger.datasets() or ledger.snapshot(name).samples < args.fill_after:
                    time.sleep(0.02)
                fill(disk)  # to the last byte, at once, while generations run
            while room_problem(disk / name, one_record, "one record") is None:
                time.sleep(0.02)
            full_at = time.monotonic()
            st = os.statvfs(disk)
            free_when_full = st.f_bavail * st.f_frsize
            at_full, tokens_at_full = ledger.snapshot(name), sim_stats(url)["generated_tokens"]
            requests_at_full = sim_stats(url)["requests"]
            peak_held = 0
            problem = ""
            while time.monotonic() - full_at < args.full_s:
                snap = ledger.snapshot(name)
                peak_held = max(peak_held, snap.held)
                problem = snap.output_error or problem
                time.sleep(0.2)
            during, stats_during = ledger.snapshot(name), sim_stats(url)
            filler.unlink()
            freed_at = time.monotonic()
            code = proc.wait(600)
            settled_s = time.monotonic() - freed_at
            stats = sim_stats(url)
            out = root / "export.jsonl"
            report = export_dataset(ledger, name, out)
            exported = [orjson.loads(line) for line in out.read_bytes().splitlines()]
            torn = sum(
                1
                for p in (disk / name).glob("part-*.jsonl")
                if p.read_bytes() and not p.read_bytes().endswith(b"\n")
            )
            snap = ledger.snapshot(name)
            logs = "".join(p.read_text(errors="replace") for p in (root / "logs").glob("*.log"))
            if os.environ.get("FULL_DISK_KEEP_LOGS"):
                Path(os.environ["FULL_DISK_KEEP_LOGS"]).write_text(logs)
    not_held = logs.count("record not held")
    print(f"machine: {machine()}")
    start = (
        f"filled to the last byte after {args.fill_after} samples"
        if args.fill_after
        else (f"{args.free_kib} KiB free at the start")
    )
    print(f"disk: {args.disk_kib} KiB tmpfs, {start}, full for {args.full_s:.0f} s")
    print(f"problem shown: {problem}")
    print(f"free when full: {free_when_full:,} bytes")
    print(f"in flight when it filled: {at_full.inflight}; held at most: {peak_held}")
    print(f"server tokens generated while full: {stats_during['generated_tokens'] - tokens_at_full:,}")
    print(f"requests started while full: {stats_during['requests'] - requests_at_full}")
    print(f"samples committed while full: {during.samples - at_full.samples}")
    print(f"requests: {stats['requests']:,} for {args.samples:,} samples")
    retried = {k: stats[k] for k in ("errors_503", "aborted", "disconnected", "dropped", "rejected")}
    print(f"server side: {retried}; ledger: wasted {snap.wasted_tokens:,} tokens, reclaimed {snap.reclaimed}")
    print(f"records not held (given back): {not_held}")
    print(f"server tokens past the export: {stats['generated_tokens'] - report.tokens:,}")
    print(
        f"exported {len(exported):,}, ledger samples {snap.samples:,}, "
        f"tokens ledger {snap.tokens:,} vs export {report.tokens:,}"
    )
    print(f"torn part files: {torn}; submit exit {code}, {settled_s:.1f} s after space was freed")


if __name__ == "__main__":
    main()
