"""What submit learns from each SGLang server before anything is enqueued: the batch size in force (the
default fleet-wide cap), the context length, the longest prompt its scheduler takes, and the model's
vocabulary size.

Facts observed on a real sglang 0.5.23 server (``shared/reference/sglang-http.md``):

- ``/server_info`` ``max_running_requests`` and ``context_length`` are the launch arguments, null unless
  given; the batch size in force is ``internal_states[i].effective_max_running_requests_per_dp``, per
  data-parallel rank, so the server's is their sum. ``max_req_input_len`` is the scheduler's prompt limit
  (a longer prompt is aborted with status 400 after it waited in the queue).
- ``/v1/models`` always has the context length (``data[0].max_model_len``).
- ``/model_info`` names the model folder (``model_path``, ``tokenizer_path``); its ``config.json`` holds
  ``vocab_size``. An id outside the vocabulary crashes the whole server, so it must be known before a
  pre-tokenized prompt is sent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.sglang.client import SGLangClient, SGLangError
from workers.sglang.protocol import MODEL_INFO_PATH, MODELS_PATH


@dataclass(frozen=True, slots=True)
class ServerFacts:
    url: str
    #: Requests the server runs at once (its batch size in force), None when it does not say.
    batch_size: int | None = None
    context_length: int | None = None
    #: The longest prompt (tokens) its scheduler takes.
    max_input_len: int | None = None
    vocab_size: int | None = None
    #: The model folder ``/model_info`` names (``model_path``), readable here or not.
    model_folder: str | None = None


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def batch_size_of(info: Mapping[str, Any]) -> int | None:
    """The batch size in force: the sum over data-parallel ranks of
    ``effective_max_running_requests_per_dp``, else the launch argument ``max_running_requests``."""
    states = info.get("internal_states")
    if isinstance(states, list) and states:
        per_rank = [
            _positive_int(s.get("effective_max_running_requests_per_dp")) if isinstance(s, dict) else None
            for s in states
        ]
        if all(n is not None for n in per_rank):
            return sum(n for n in per_rank if n is not None)
    running = _positive_int(info.get("max_running_requests"))
    if running is None and isinstance(states, list) and states and isinstance(states[0], dict):
        running = _positive_int(states[0].get("max_running_requests"))
    return running


def vocab_size_of(model_info: Mapping[str, Any]) -> int | None:
    """``vocab_size`` from the ``config.json`` of the folder ``/model_info`` names, when it is readable
    here (the server's own folder on its host; a shared or identical path on ours)."""
    for key in ("model_path", "tokenizer_path"):
        folder = model_info.get(key)
        if not isinstance(folder, str) or not folder:
            continue
        try:
            config = json.loads((Path(folder) / "config.json").read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(config, dict):
            continue
        size = _positive_int(config.get("vocab_size"))
        text_config = config.get("text_config")
        if size is None and isinstance(text_config, dict):  # multimodal configs nest the text model's
            size = _positive_int(text_config.get("vocab_size"))
        if size is not None:
            return size
    return None


def learn(client: SGLangClient, url: str, info: Mapping[str, Any] | None = None) -> ServerFacts:
    """Ask ``url`` (its ``/server_info``, or ``info`` when already read); a fact it does not tell is None.
    Raises ``SGLangError`` when ``/server_info`` does not answer."""
    if info is None:
        info = client.server_info(url)
    context = _positive_int(info.get("context_length")) or _models_context_length(client, url)
    try:
        model_info = client.get_json(url, MODEL_INFO_PATH)
    except (SGLangError, ValueError):
        model_info = {}
    return ServerFacts(
        url=url,
        batch_size=batch_size_of(info),
        context_length=context,
        max_input_len=_positive_int(info.get("max_req_input_len")),
        vocab_size=vocab_size_of(model_info) if isinstance(model_info, dict) else None,
        model_folder=model_folder_of(model_info) if isinstance(model_info, dict) else None,
    )


def model_folder_of(model_info: Mapping[str, Any]) -> str | None:
    """The model folder ``/model_info`` names (``model_path``, else ``tokenizer_path``), or None."""
    for key in ("model_path", "tokenizer_path"):
        folder = model_info.get(key)
        if isinstance(folder, str) and folder:
            return folder
    return None


def vocab_unknown_warning(servers: Mapping[str, ServerFacts], config_path: str) -> str:
    """What submit cannot check with the vocabulary unknown, and how to make it check."""
    folders = sorted({f.model_folder for f in servers.values() if f.model_folder})
    if folders:
        named = ", ".join(folders)
        why = f"the servers name the model folder {named}, whose config.json is not readable here"
        fix = f"make {folders[0]}/config.json readable on this host, or set [server] vocab_size in "
        fix += config_path
    else:
        why = "no server names its model folder (/model_info)"
        fix = f"set [server] vocab_size in {config_path}"
    return (
        f"the model's vocabulary size is unknown ({why}): pre-tokenized ids are checked only against 2^31 "
        f"(beyond every model), not against the model's vocabulary, and an id outside it crashes a real "
        f"SGLang server; to have them checked, {fix}"
    )


def _models_context_length(client: SGLangClient, url: str) -> int | None:
    try:
        models = client.get_json(url, MODELS_PATH).get("data") or [{}]
    except (SGLangError, ValueError, AttributeError):
        return None
    return _positive_int(models[0].get("max_model_len")) if isinstance(models[0], dict) else None


def smallest(values: Sequence[int | None]) -> int | None:
    """The smallest known value (what every server takes), or None when none is known."""
    return min((v for v in values if v is not None), default=None)
