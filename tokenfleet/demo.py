"""``tokenfleet demo``: a whole generation on this machine with only Python installed.

It starts what is missing (an embedded Redis when none answers, the simulator, two worker processes),
submits the bundled example datasets with a token budget and a sample cap, shows the live status, exports
the results and says where they are.
"""

from __future__ import annotations

import shutil
from contextlib import ExitStack
from importlib import resources
from pathlib import Path
from typing import Final

from rich.console import Console

from budget import Ledger
from budget.urls import redis_url_from_env
from tokenfleet.config import load_config, redact_url
from tokenfleet.export import export_dataset
from tokenfleet.processes import embedded_redis, redis_answers, start_worker, stop_process, wait_for_workers
from tokenfleet.sim import SimConfig, SimServerThread
from tokenfleet.status_view import status_table
from tokenfleet.submit import run_submit

DEMO_DATASETS: Final = ("demo_instructions", "demo_pretokenized")
DEMO_WORKERS: Final = 2
DEMO_CONCURRENCY: Final = 16

CONFIG_TEMPLATE: Final = """\
# Written by `tokenfleet demo`: the same config a real run takes, pointed at the simulator.
redis_url = "{redis_url}"
output_dir = "out"

[server]
urls = ["{sim_url}"]
timeout_s = 60

[sampling]
max_new_tokens = 256
temperature = 0.7

[[dataset]]
name = "demo_instructions"
path = "data/instructions.jsonl"
token_budget = 12000        # stops here, mid-dataset: its in-flight generations are cut at the budget

[[dataset]]
name = "demo_pretokenized"
path = "data/pretokenized.jsonl"
max_samples = 100           # stops after exactly 100 samples
[dataset.sampling]
max_new_tokens = 128
"""


def write_demo_config(workdir: Path, redis_url: str, sim_url: str) -> Path:
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    examples = resources.files("tokenfleet") / "examples"
    for name in ("instructions.jsonl", "pretokenized.jsonl"):
        (data / name).write_bytes((examples / name).read_bytes())
    config = workdir / "demo.toml"
    config.write_text(CONFIG_TEMPLATE.format(redis_url=redis_url, sim_url=sim_url))
    return config


def run_demo(console: Console, workdir: Path, redis_url: str | None = None) -> int:
    workdir = workdir.absolute()
    url = redis_url or redis_url_from_env()
    with ExitStack() as stack:
        if not redis_answers(url):
            console.print(f"no Redis answers at {redact_url(url)}: starting an embedded one")
            url = stack.enter_context(embedded_redis(workdir / "redis"))
        sim = stack.enter_context(SimServerThread(SimConfig(port=0, step_time_s=0.005, output_len_mean=120)))
        console.print(f"simulator (SGLang protocol) at {sim.url}; Redis at {redact_url(url)}")

        ledger = Ledger.from_url(url)
        for name in DEMO_DATASETS:  # a demo starts afresh; a real submit resumes instead
            ledger.forget(name)
        shutil.rmtree(workdir / "out", ignore_errors=True)
        config = write_demo_config(workdir, url, sim.url)

        names = [f"demo{i}" for i in range(DEMO_WORKERS)]
        for name in names:
            proc = start_worker(
                url, concurrency=DEMO_CONCURRENCY, name=name, log_path=workdir / f"{name}.log"
            )
            stack.callback(stop_process, proc)
        wait_for_workers(url, names)
        console.print(f"{DEMO_WORKERS} workers up; submitting {config}")

        snaps = run_submit(load_config(config, env={}), console, window=64)
        console.print(status_table(snaps, title="demo: settled"))
        exports = workdir / "exports"
        for name in DEMO_DATASETS:
            report = export_dataset(ledger, name, exports / f"{name}.jsonl")
            console.print(f"  {name}: {report.records} samples, {report.tokens:,} tokens -> {report.path}")
        console.print(f"config: {config}\nrecords as workers wrote them: {workdir / 'out'}")
    return 0
