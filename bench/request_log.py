"""Where a budget run's end went, from the simulator's log of requests (``tokenfleet.sim --request-log``).

``bench/scale.py budget-speed --speed-timeline DIR`` writes one log per cell (``DIR/<workload>-<inflight>
.requests.jsonl``), every run of the cell in it; each run's dataset is told by the rid's tag. For each
dataset in the log (``--last``: the last one only), this prints:

- the requests that ended at their ``max_new_tokens`` (finish ``length``: under a truncate budget, at
  their grant) by when they started, a quarter second at a time: how many, their mean tokens and when
  they ended. Grants made to a common horizon end together; a spread here is time the servers ran part
  empty at the end;
- the requests running and those ending at ``length``, every 0.1 s over the last ``--tail-s`` seconds.

    python bench/request_log.py DIR/mean400-1024.requests.jsonl --last
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.rids import RID_LENGTH, TAG_LENGTH


@dataclass(frozen=True, slots=True)
class Request:
    rid: str
    arrived_s: float
    started_s: float | None
    ended_s: float
    completion_tokens: int
    finish: str | None


def read_log(path: Path) -> dict[str, list[Request]]:
    """The log's requests by dataset tag, the datasets in the order of their first request."""
    by_tag: dict[str, list[Request]] = {}
    for raw in path.read_bytes().splitlines():
        if not raw.strip():
            continue
        d = orjson.loads(raw)
        if len(d["rid"]) != RID_LENGTH:  # not a generation's (a worker's probe of the server)
            continue
        r = Request(
            d["rid"], d["arrived_s"], d["started_s"], d["ended_s"], d["completion_tokens"], d["finish"]
        )
        by_tag.setdefault(r.rid[:TAG_LENGTH], []).append(r)
    return by_tag


def grant_ends(requests: list[Request], t0: float, bucket_s: float = 0.25) -> list[str]:
    """The requests that ended at ``length``, by when they started."""
    buckets: dict[int, list[Request]] = defaultdict(list)
    for r in requests:
        if r.started_s is not None and r.finish == "length":
            buckets[int((r.started_s - t0) / bucket_s)].append(r)
    lines = [
        f"{'started at':>10} | {'ended at length':>15} | {'mean tokens':>11} | {'ended: mean [min, max]':>24}"
    ]
    for b in sorted(buckets):
        rs = buckets[b]
        ends = [r.ended_s - t0 for r in rs]
        mean_tokens = sum(r.completion_tokens for r in rs) / len(rs)
        lines.append(
            f"{b * bucket_s:>8.2f} s | {len(rs):>15} | {mean_tokens:>11.1f} | "
            f"{sum(ends) / len(ends):>7.2f} s [{min(ends):5.2f}, {max(ends):5.2f}]"
        )
    return lines


def tail(requests: list[Request], t0: float, tail_s: float, step_s: float = 0.1) -> list[str]:
    """Running requests and ends at ``length`` every ``step_s`` over the last ``tail_s`` seconds."""
    end = max(r.ended_s for r in requests)
    lines = [f"{'at':>7} | {'running':>7} | {'ended at length':>15}"]
    t = max(t0, end - tail_s)
    while t <= end + step_s:
        running = sum(1 for r in requests if r.started_s is not None and r.started_s <= t < r.ended_s)
        ended = sum(1 for r in requests if t <= r.ended_s < t + step_s and r.finish == "length")
        lines.append(f"{t - t0:>5.2f} s | {running:>7} | {ended:>15}")
        t += step_s
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("log", type=Path, help="a log of requests (tokenfleet.sim --request-log)")
    parser.add_argument("--last", action="store_true", help="the log's last dataset only")
    parser.add_argument("--tail-s", type=float, default=2.0, help="the seconds before the last end to show")
    args = parser.parse_args()
    by_tag = read_log(args.log)
    if not by_tag:
        raise SystemExit(f"{args.log}: no request in the log")
    tags = list(by_tag)[-1:] if args.last else list(by_tag)
    for tag in tags:
        requests = by_tag[tag]
        t0 = min(r.arrived_s for r in requests)
        ended_last = max(r.ended_s for r in requests) - t0
        print(
            f"dataset {tag}: {len(requests)} requests; the first arrived at 0 s, "
            f"the last ended at {ended_last:.2f} s"
        )
        print()
        print("\n".join(grant_ends(requests, t0)))
        print()
        print("\n".join(tail(requests, t0, args.tail_s)))
        print()


if __name__ == "__main__":
    main()
