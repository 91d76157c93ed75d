"""Configs and JSONL files written to a test's temp folder, and names no other test uses."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import orjson


def unique(name: str) -> str:
    return f"{name}_{uuid.uuid4().hex[:8]}"


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def toml_value(v: Any) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return str(v)


def write_config(
    folder: Path,
    *,
    redis_url: str,
    servers: list[str],
    datasets: list[dict[str, Any]],
    sampling: dict[str, Any] | None = None,
    top: dict[str, Any] | None = None,
) -> Path:
    """A TOML config; each dataset dict has name, rows (written to data/NAME.jsonl) and other keys."""
    lines = [f"redis_url = {toml_value(redis_url)}", 'output_dir = "out"']
    for k, v in (top or {}).items():
        lines.append(f"{k} = {toml_value(v)}")
    lines += ["", "[server]", f"urls = {toml_value(servers)}", "timeout_s = 60", "", "[sampling]"]
    for k, v in (sampling or {"max_new_tokens": 256}).items():
        lines.append(f"{k} = {toml_value(v)}")
    for ds in datasets:
        ds = dict(ds)
        rows = ds.pop("rows", None)
        ds_sampling = ds.pop("sampling", None)
        if rows is not None:
            write_jsonl(folder / "data" / f"{ds['name']}.jsonl", rows)
            ds.setdefault("path", f"data/{ds['name']}.jsonl")
        lines += ["", "[[dataset]]"] + [f"{k} = {toml_value(v)}" for k, v in ds.items()]
        if ds_sampling:
            lines += ["[dataset.sampling]"] + [f"{k} = {toml_value(v)}" for k, v in ds_sampling.items()]
    path = folder / "tokenfleet.toml"
    path.write_text("\n".join(lines) + "\n")
    return path
