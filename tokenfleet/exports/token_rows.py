"""Rows of exact token ids: the whole sequence the model saw and produced, with a loss mask over it.

- ``specforge-tokens``: ``{"id", "input_ids", "loss_mask"}``, one row per sample. SpecForge 0.2.0's prompt
  loader (``specforge.data.prompt_builder.prepare_prompt_tasks``, behind ``data.prompts_path`` and
  ``train_data_path``) treats a file whose first record has ``input_ids`` and ``loss_mask`` as pre-tokenized:
  both must be flat integer lists of the same length (the mask 0/1), and a row with no 1 in its mask is
  dropped (``min_loss_tokens`` defaults to 1). It takes the ids as they are: no chat template, no
  re-tokenization.
- ``speculators``: vllm-project/speculators' response regeneration output
  (``scripts/response_regeneration/script.py``, ``build_boundary_sample`` and ``_sample_from_response``):
  one row per generation, ``{"id": "<conversation>_gen<N>", "primary_id", "input_ids": prompt + completion,
  "loss_mask": [0] * prompt + [1] * completion, "conversations": [...], "metadata": {"finish_reason",
  "usage", ...}}``. Its ``conversations`` is a review-only twin of the ids (training reads the ids). Our
  ``metadata.reasoning_tokens`` says how many of the reply's completion tokens the model spent thinking.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["loss_mask", "sequence", "specforge_tokens_row", "speculators_rows"]


def loss_mask(record: Mapping[str, Any]) -> list[int]:
    """1 on generated tokens of ``input_ids + output_ids``: the output, and each earlier reply of a
    conversation that stands verbatim at its place in the last prompt (``in_context``). A record without
    ``input_ids`` (a text prompt the server tokenized) has a mask over its output only."""
    prompt = record.get("input_ids") or []
    mask = [0] * len(prompt) + [1] * len(record.get("output_ids") or [])
    for turn in (record.get("turns") or [])[:-1]:
        if turn.get("in_context"):
            start = int(turn["prompt_tokens"])
            mask[start : start + len(turn["output_ids"])] = [1] * len(turn["output_ids"])
    return mask


def sequence(record: Mapping[str, Any]) -> tuple[list[int], list[int]] | None:
    """The exact prompt ids followed by the exact generated ids, and the loss mask over them; None for a
    record whose prompt the server tokenized (its prompt ids are not known)."""
    prompt = record.get("input_ids")
    if prompt is None:
        return None
    return [*prompt, *(record.get("output_ids") or [])], loss_mask(record)


def specforge_tokens_row(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """The sample as one pre-tokenized SpecForge row, or None when its prompt ids are not known."""
    seq = sequence(record)
    if seq is None:
        return None
    ids, mask = seq
    return {"id": str(record["id"]), "input_ids": ids, "loss_mask": mask}


def _finish_type(finish_reason: Any) -> str | None:
    # SGLang's finish_reason is {"type": "stop" | "length" | "abort", ...}; OpenAI's (which the speculators
    # script copies from vLLM's chat completion) is the type alone.
    if isinstance(finish_reason, Mapping):
        kind = finish_reason.get("type")
        return str(kind) if kind is not None else None
    return str(finish_reason) if finish_reason is not None else None


def speculators_rows(
    record: Mapping[str, Any], conversation: list[dict[str, str]] | None
) -> tuple[list[dict[str, Any]], int]:
    """One speculators regeneration row per reply whose exact prompt is known, and how many replies are
    left out because it is not.

    A single reply's prompt is the record's ``input_ids``. In a conversation regenerated turn by turn the
    record keeps the last prompt; an earlier reply marked ``in_context`` stands verbatim in it, so its own
    prompt is the last prompt's first ``prompt_tokens`` ids (every later prompt starts with the one before
    it). An earlier reply the template rewrote has no exact prompt on record and is left out.
    """
    prompt = record.get("input_ids")
    if prompt is None:
        return [], 1
    sid = str(record["id"])
    turns = record.get("turns") or [
        {
            "prompt_tokens": len(prompt),
            "output_ids": record.get("output_ids") or [],
            "finish_reason": record.get("finish_reason"),
            "reasoning_tokens": record.get("reasoning_tokens"),
            "in_context": True,
        }
    ]
    # The conversation up to each reply (system and user turns, then the reply), for review.
    prefixes: list[list[dict[str, str]]] = []
    if conversation:
        for i, turn in enumerate(conversation):
            if turn["role"] == "assistant":
                prefixes.append(conversation[: i + 1])
    rows: list[dict[str, Any]] = []
    left_out = 0
    last = len(turns) - 1
    for n, turn in enumerate(turns):
        if n < last and not turn.get("in_context"):
            left_out += 1
            continue
        head = list(prompt) if n == last else list(prompt[: int(turn["prompt_tokens"])])
        output = list(turn.get("output_ids") or [])
        rows.append(
            {
                "id": f"{sid}_gen{n}",
                "primary_id": sid,
                "input_ids": head + output,
                "loss_mask": [0] * len(head) + [1] * len(output),
                "conversations": prefixes[n] if n < len(prefixes) else [],
                "metadata": {
                    "idx": n,
                    "finish_reason": _finish_type(turn.get("finish_reason")),
                    "usage": {
                        "prompt_tokens": len(head),
                        "completion_tokens": len(output),
                        "total_tokens": len(head) + len(output),
                    },
                    "truncated": bool(record.get("truncated")) and n == last,
                    "reasoning_tokens": int(turn.get("reasoning_tokens") or 0),
                },
            }
        )
    return rows, left_out
