"""CPU per ``POST /generate`` for the HTTP clients a worker could use, against the simulator.

Why the data plane (workers/sglang/wire.py) uses http.client and not httpx: one thread posts short
generations (8 tokens) one after another, the raw clients asking for whole answers and SGLangClient
streaming them as the workers do; the figure is this process's CPU time per
request (``time.process_time``), the median of the repeats, and its ratio to httpx's.

    python bench/http_clients.py
    python bench/http_clients.py --requests 3000 --repeats 7
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import machine, median, print_table, sim_process
from workers.sglang.client import SGLangClient
from workers.sglang.wire import Wire

SAMPLING = {"max_new_tokens": 8, "stream_interval": 8}


def body() -> bytes:
    return orjson.dumps({"input_ids": list(range(32)), "rid": uuid.uuid4().hex, "sampling_params": SAMPLING})


def cpu_ms_per_request(post: Callable[[], object], n: int) -> float:
    for _ in range(min(50, n)):  # connections up, code warm
        post()
    started = time.process_time()
    for _ in range(n):
        post()
    return (time.process_time() - started) / n * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    results: dict[str, list[float]] = {}
    with sim_process(step_time_s=0.001, fixed_output_len=7) as url:
        headers = {"Content-Type": "application/json"}
        http = httpx.Client(headers=headers)
        wire = Wire()
        client = SGLangClient()

        def via_httpx() -> object:
            return orjson.loads(http.post(url + "/generate", content=body()).content)

        def via_wire() -> object:
            with wire.post(url, "/generate", body(), timeout_s=60, connect_timeout_s=10) as exchange:
                answer = orjson.loads(exchange.response.read())
                exchange.complete = True
                return answer

        def via_sglang_client() -> object:
            return client.generate(
                url, rid=uuid.uuid4().hex, sampling_params=SAMPLING, input_ids=list(range(32))
            )

        candidates: dict[str, Callable[[], object]] = {
            "httpx.Client.post (baseline)": via_httpx,
            "wire.Wire.post (http.client)": via_wire,
            "SGLangClient.generate (wire, streamed)": via_sglang_client,
        }
        for i in range(args.repeats):
            for name, post in candidates.items():
                results.setdefault(name, []).append(cpu_ms_per_request(post, args.requests))
            print(f"  repeat {i + 1}/{args.repeats} done", file=sys.stderr)
        http.close()
        wire.close()
        client.close()

    base = median(results["httpx.Client.post (baseline)"])
    rows = [
        [name, f"{median(values):.3f}", f"{median(values) / base:.2f}"] for name, values in results.items()
    ]
    print(
        f"\nmachine: {machine()}; {args.requests} requests per run, one thread, 8-token answers; "
        f"medians of {args.repeats} runs\n"
    )
    print_table(["client", "CPU ms per request", "ratio to httpx"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
