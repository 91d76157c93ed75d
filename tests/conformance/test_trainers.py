"""The exports as the trainer loads them: a chat dataset generated on the real SGLang server with the tiny
model's own tokenizer and chat template, exported, and loaded with SpecForge 0.2.0's own data code
(``prepare_prompt_tasks``, run in the server's venv by ``specforge_load.py``).

- ``specforge-tokens``: every exported row loads, none is dropped, and under each row's mask stand exactly
  the ids the model generated (single replies, and every reply of conversations regenerated turn by turn).
- ``specforge``: every row loads; the replies SpecForge re-tokenizes to other ids than the generated ones
  are counted by the export before any trainer sees them.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from budget import Ledger
from tests.conformance.helpers import Submit, Workers
from tests.conformance.real_server import RealServer
from tests.support.files import read_jsonl, toml_value, write_jsonl
from tokenfleet.export import ExportReport, export_dataset
from tokenfleet.exports.retokenize import content_ids
from workers.rids import dataset_tag

pytestmark = [pytest.mark.conformance, pytest.mark.timeout(600)]

LOADER = Path(__file__).with_name("specforge_load.py")
SYSTEM = "You answer in a few words."
SINGLE, MULTI, MULTI_REPLIES = 28, 12, 3
WORDS = ("the", "a", "of", "water", "light", "bread", "stone", "river", "why", "how", "what")


def tiny_model(server: RealServer) -> Path:
    return server.root / "tiny-llama"


def question(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) + "?"


def conversations(seed: int, n: int, replies: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        messages: list[dict[str, str]] = []
        for _ in range(replies):
            messages.append({"role": "user", "content": question(rng)})
            messages.append({"role": "assistant", "content": question(rng)})
        rows.append({"id": f"c{seed}-{i}", "messages": messages})
    return rows


def write_config(folder: Path, redis_url: str, server: RealServer, datasets: list[dict[str, Any]]) -> Path:
    lines = [
        f"redis_url = {toml_value(redis_url)}",
        'output_dir = "out"',
        f"tokenizer = {toml_value(str(tiny_model(server)))}",
        f"system_prompt = {toml_value(SYSTEM)}",
        "",
        "[server]",
        f"urls = {toml_value([server.url])}",
        "timeout_s = 120",
        "",
        "[sampling]",
        "max_new_tokens = 24",
        "temperature = 1.0",
    ]
    for ds in datasets:
        write_jsonl(folder / "data" / f"{ds['name']}.jsonl", ds["rows"])
        lines += ["", "[[dataset]]", f"name = {toml_value(ds['name'])}", f'path = "data/{ds["name"]}.jsonl"']
        lines.append(f"regenerate = {toml_value(ds['regenerate'])}")
        lines += [f"{k} = {toml_value(v)}" for k, v in ds.items() if k not in ("name", "rows", "regenerate")]
    path = folder / "tokenfleet.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def load_with_specforge(
    server: RealServer, export: Path, tmp_path: Path
) -> tuple[list[str], list[dict[str, Any]]]:
    out = tmp_path / f"{export.name}.loaded.json"
    done = subprocess.run(
        [
            str(server.root / "venv" / "bin" / "python"),
            str(LOADER),
            str(export),
            str(tiny_model(server)),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(out.read_text())
    return loaded["ids"], loaded["rows"]


def masked_spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            spans.append((start, i))
            start = None
    return spans


def generated(record: dict[str, Any]) -> list[list[int]]:
    """Each reply's generated ids that stand verbatim in the sequence (the last, and each earlier one the
    worker found ``in_context``), in order."""
    if not record.get("turns"):
        return [record["output_ids"]]
    turns = record["turns"]
    return [t["output_ids"] for n, t in enumerate(turns) if t["in_context"] or n == len(turns) - 1]


def export(ledger: Ledger, name: str, tmp_path: Path, fmt: str) -> ExportReport:
    report = export_dataset(ledger, name, tmp_path / "exports" / f"{name}.{fmt}.jsonl", format=fmt)
    assert report.missing == 0
    return report


def test_specforge_loads_every_exported_row_with_exactly_the_generated_ids_under_its_mask(
    conformance_workers: Workers,
    fleet_redis_url: str,
    fleet_ledger: Ledger,
    live_server: RealServer,
    dataset_name: Any,
    tmp_path: Path,
) -> None:
    single, multi = dataset_name("sf_single"), dataset_name("sf_multi")
    config = write_config(
        tmp_path,
        fleet_redis_url,
        live_server,
        [
            {"name": single, "rows": conversations(1, SINGLE, 2), "regenerate": "last"},
            {"name": multi, "rows": conversations(2, MULTI, MULTI_REPLIES), "regenerate": "all"},
        ],
    )
    assert Submit(config, "--window", "64").wait() == 0

    figures: dict[str, Any] = {}
    for name in (single, multi):
        records = {r["id"]: r for r in read_jsonl(export(fleet_ledger, name, tmp_path, "tokens").path)}
        assert len(records) == (SINGLE if name == single else MULTI)

        # Exact ids: every row loads, none dropped, the generated ids and only those under the mask.
        tokens = export(fleet_ledger, name, tmp_path, "specforge-tokens")
        ids, rows = load_with_specforge(live_server, tokens.path, tmp_path)
        assert len(rows) == tokens.records == len(records)
        exact = 0
        for sid, row in zip(ids, rows, strict=True):
            record = records[sid]
            assert row["input_ids"] == record["input_ids"] + record["output_ids"]
            under_mask = [row["input_ids"][a:b] for a, b in masked_spans(row["loss_mask"])]
            # Adjacent replies cannot touch (a template header stands between them): one span per reply.
            exact += under_mask == generated(record)
        assert exact == len(records)
        figures[f"{name}_replies_under_mask"] = sum(len(generated(r)) for r in records.values())
        figures[f"{name}_replies"] = sum(len(r.get("turns") or [r]) for r in records.values())

        # Conversation text: every row loads; the replies SpecForge tokenizes to other ids are counted.
        text = export(fleet_ledger, name, tmp_path, "specforge")
        ids, rows = load_with_specforge(live_server, text.path, tmp_path)
        assert len(rows) == text.records == len(records)
        assert text.no_system_turn == 0
        replies = same = 0
        wrong: set[tuple[str, int]] = set()  # (sample, reply) whose ids SpecForge did not reproduce
        for sid, row in zip(ids, rows, strict=True):
            record = records[sid]
            turns = record.get("turns") or [record]
            # SpecForge masks every assistant turn: with regenerate = "last" the earlier ones are the
            # source's, and the generated replies are the last spans.
            spans = masked_spans(row["loss_mask"])[-len(turns) :]
            assert len(spans) == len(turns)
            for k, ((a, _b), turn) in enumerate(zip(spans, turns, strict=True), start=1):
                replies += 1
                # SpecForge's span ends with the template's end of turn ("\n"); the text has no stop token.
                want = content_ids(turn["output_ids"], turn.get("finish_reason"))
                if row["input_ids"][a : a + len(want)] == want:
                    same += 1
                else:
                    wrong.add((sid, k))
        figures[name] = {
            "tokens_rows": f"{len(rows)}/{tokens.records}",
            "text_replies": replies,
            "text_exact_by_specforge": same,
            "text_mismatches_reported": text.mismatches,
        }
        assert text.replies_checked == replies
        # Every reply SpecForge trains on other ids than the generated ones is reported, with its sample
        # and reply. The export may report more: a reply whose ids SpecForge reproduces after a prompt
        # the model never saw (the template renders the prompt otherwise) is not what was generated either.
        assert text.mismatch_path is not None
        reported = {(m["id"], m["reply"]) for m in read_jsonl(text.mismatch_path)}
        assert len(reported) == text.mismatches
        assert wrong <= reported, f"not reported: {sorted(wrong - reported)}"
    print(json.dumps(figures))


def test_a_truncate_budget_on_conversations_is_spent_to_the_token_by_the_server_with_replies_continued(
    conformance_workers: Workers,
    fleet_redis_url: str,
    fleet_ledger: Ledger,
    live_server: RealServer,
    dataset_name: Any,
    tmp_path: Path,
) -> None:
    # 24 conversations of 3 replies of up to 24 tokens on 32 slots: 600 tokens are shares below a reply's
    # max_new_tokens, so replies reach their grants and go on in new requests until the budget is spent
    name, budget = dataset_name("chat_budget"), 600
    rows = conversations(3, 24, MULTI_REPLIES)
    dataset = {"name": name, "rows": rows, "regenerate": "all", "token_budget": budget}
    config = write_config(tmp_path, fleet_redis_url, live_server, [dataset])
    live_server.wait_idle()

    assert Submit(config, "--window", "64").wait() == 0

    live_server.wait_idle()
    served = live_server.requests(dataset_tag(name))
    records = read_jsonl(export(fleet_ledger, name, tmp_path, "tokens").path)
    snap = fleet_ledger.snapshot(name)
    replies = sum(len(r.get("turns") or [r]) for r in records)
    print(
        f"budget {budget}: {len(records)} conversations, {replies} replies in {len(served)} requests, "
        f"{snap.truncated} cut, {sum(r.completion_tokens or 0 for r in served.values())} tokens served"
    )
    assert snap.state == "exhausted"
    # every request went out with max_new_tokens within the conversation's grant: the server stopped there
    assert snap.tokens == sum(r["completion_tokens"] for r in records) == budget
    assert sum(r.completion_tokens or 0 for r in served.values()) == budget
    assert snap.overdrawn_tokens == 0 and snap.reserved_tokens == 0
    assert len(served) > replies  # replies went on past their grants
    assert sum(r["requests"] for r in records) == len(served)
    assert 0 < snap.truncated <= len(records)
