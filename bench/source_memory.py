"""Producer memory over a long chat source: does reading 1M records stay flat?

Writes a chat source of N lines (OpenAI ``messages`` records, two user/assistant exchanges each, about 60
words) as JSON Lines and as Parquet (row groups of 10,000 rows), both written as a stream, into a temp
folder. Then, for each container, a fresh Python process reads it the way ``submit`` does: `iter_source`
with a dataset `RecordReader` (format auto, the chat template of a small word-level tokenizer the script
builds, regenerate = "last", the context-length check), down to exact prompt token ids. The child samples
its resident memory (VmRSS) as it goes and reports its peak (``ru_maxrss``) and lines per second.

    python bench/source_memory.py                   # 1,000,000 lines, JSON Lines and Parquet
    python bench/source_memory.py --lines 100000    # quicker

Memory is flat when the RSS after the whole stream is what it was after the first 10% of it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # no "PyTorch was not found" line

#: Parquet row group size of the generated file (pyarrow reads one row group at a time).
ROW_GROUP_ROWS = 10_000
#: How often the reader samples its RSS.
SAMPLE_EVERY = 50_000
WORDS = [f"w{i}" for i in range(500)]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def machine() -> str:
    import platform

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def make_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer with a ChatML template, built locally (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate([*specials, "system", "user", "assistant", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", unk_token="<unk>")
    tok.chat_template = CHATML
    tok.save_pretrained(str(folder))
    return folder


def record(i: int, rng: random.Random) -> dict[str, Any]:
    def text(n: int) -> str:
        return " ".join(rng.choices(WORDS, k=n))

    messages = []
    for _ in range(2):
        messages.append({"role": "user", "content": text(rng.randint(5, 25))})
        messages.append({"role": "assistant", "content": text(rng.randint(5, 25))})
    return {"id": f"s{i}", "messages": messages, "source": "bench"}


def write_sources(folder: Path, lines: int) -> dict[str, Path]:
    import orjson
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    jsonl, parquet = folder / "chat.jsonl", folder / "chat.parquet"
    writer: pq.ParquetWriter | None = None
    with jsonl.open("wb") as f:
        for start in range(0, lines, ROW_GROUP_ROWS):
            rows = [record(i, rng) for i in range(start, min(lines, start + ROW_GROUP_ROWS))]
            f.write(b"".join(orjson.dumps(r) + b"\n" for r in rows))
            table = pa.Table.from_pylist(rows)
            if writer is None:
                writer = pq.ParquetWriter(parquet, table.schema)
            writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
    assert writer is not None
    writer.close()
    return {"jsonl": jsonl, "parquet": parquet}


def status_mib(field: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process, in MiB. Not ``ru_maxrss``: Linux
    carries it over from the parent across fork and exec."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(path: Path, tokenizer: Path, lines: int) -> None:
    """Read the whole source like submit does; print one JSON line of measurements."""
    from producer.source import RecordReader, Sample, SourceOptions, iter_source

    reader = RecordReader(SourceOptions(tokenizer=str(tokenizer), context_length=32768, max_new_tokens=4096))
    before = status_mib("VmRSS")
    samples: list[tuple[int, float]] = []
    n = prompt_tokens = 0
    start = time.perf_counter()
    for item in iter_source(path, reader=reader):
        n += 1
        if isinstance(item, Sample) and item.input_ids is not None:
            prompt_tokens += len(item.input_ids)
        if n % SAMPLE_EVERY == 0:
            samples.append((n, status_mib("VmRSS")))
    elapsed = time.perf_counter() - start
    assert n == lines, (n, lines)
    peak = status_mib("VmHWM")
    print(json.dumps({"lines": n, "s": elapsed, "before": before, "samples": samples, "peak": peak,
                      "prompt_tokens": prompt_tokens}))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lines", type=int, default=1_000_000)
    p.add_argument("--containers", nargs="+", default=["jsonl", "parquet"], choices=["jsonl", "parquet"])
    p.add_argument("--child", nargs=3, metavar=("PATH", "TOKENIZER", "LINES"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(Path(args.child[0]), Path(args.child[1]), int(args.child[2]))
        return

    with tempfile.TemporaryDirectory(prefix="tokenfleet-bench-") as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        tokenizer = make_tokenizer(folder / "tokenizer")
        sources = write_sources(folder, args.lines)
        sizes = {k: v.stat().st_size / 2**20 for k, v in sources.items()}
        took = time.perf_counter() - t0
        print(f"wrote {args.lines:,} lines in {took:.0f} s (JSONL {sizes['jsonl']:.0f} MiB, ", end="")
        print(f"Parquet {sizes['parquet']:.0f} MiB); {machine()}")
        print()
        print(
            "| container | lines | lines/s | RSS before reading | RSS at 10% | RSS at 100% | growth | peak |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for name in args.containers:
            argv = [sys.executable, __file__, "--child", str(sources[name]), str(tokenizer), str(args.lines)]
            out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
            m = json.loads(out.strip().splitlines()[-1])
            series = m["samples"] or [[m["lines"], m["peak"]]]
            tenth = next((rss for n, rss in series if n >= m["lines"] // 10), series[0][1])
            last = series[-1][1]
            print(
                f"| {name} | {m['lines']:,} | {m['lines'] / m['s']:,.0f} | {m['before']:.0f} MiB | "
                f"{tenth:.0f} MiB | {last:.0f} MiB | {last - tenth:+.1f} MiB | {m['peak']:.0f} MiB |"
            )


if __name__ == "__main__":
    main()
