"""Record shapes of a dataset source, and how each becomes one normalised `Record`.

A record (a JSON object, or a row of a columnar source) holds its prompt in one of these shapes:

=============  ======================================================================================
``input_ids``  ``{"input_ids": [int, ...]}``: exact tokens, sent as they are
``text``       ``{"text": str}`` or ``{"prompt": str}``: one user message
``messages``   ``{"messages": [{"role", "content"}, ...]}`` (OpenAI chat; ``content`` may be a list of
               text parts)
``sharegpt``   ``{"conversations": [{"from": "human" | "gpt" | "system", "value"}, ...]}``
``specforge``  ``{"conversations": [{"role", "content"}, ...]}``
=============  ======================================================================================

With ``format = "auto"`` (the default) each record's shape is told by its keys, in the order of the table
(a record with both ``input_ids`` and ``text`` is an ``input_ids`` record and keeps its ``text`` in meta),
and ``conversations`` is ShareGPT or SpecForge by its turns' keys. A forced format reads only its own key.
A key whose value is null counts as absent. The id is the ``id_field`` (default ``id``) when present,
otherwise derived from the record's content; every other field is kept as meta.

Nothing here tokenizes: chat turns come out as ``{"role", "content"}`` dicts for `chat.templates`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

import orjson

__all__ = [
    "CHAT_SHAPES",
    "FORMATS",
    "PLAIN",
    "ROLES",
    "Format",
    "Record",
    "derive_sample_id",
    "read_record",
]

#: What ``format`` may say in the config.
Format = Literal["auto", "messages", "sharegpt", "specforge", "text", "input_ids"]
FORMATS: Final[tuple[str, ...]] = get_args(Format)
#: Record shapes whose prompt is a conversation, written with the model's chat template.
CHAT_SHAPES: Final = frozenset({"messages", "sharegpt", "specforge"})
#: The original tokenfleet line (``input_ids`` or ``text``, nothing else): what `iter_source` reads when
#: no dataset options are given.
PLAIN: Final = "plain"

#: Roles of a normalised turn.
ROLES: Final = ("system", "user", "assistant")
#: Role names of each chat shape, mapped to ours.
_MESSAGE_ROLES: Final[Mapping[str, str]] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
}
_SHAREGPT_ROLES: Final[Mapping[str, str]] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
}

_INPUT_IDS: Final = "input_ids"
_TEXT: Final = "text"
_PROMPT: Final = "prompt"
_MESSAGES: Final = "messages"
_CONVERSATIONS: Final = "conversations"

#: The keys each format looks for, in order; the first one present decides the record's shape.
_KEYS: Final[Mapping[str, tuple[str, ...]]] = {
    PLAIN: (_INPUT_IDS, _TEXT),
    "auto": (_INPUT_IDS, _MESSAGES, _CONVERSATIONS, _TEXT, _PROMPT),
    "input_ids": (_INPUT_IDS,),
    "text": (_TEXT, _PROMPT),
    "messages": (_MESSAGES,),
    "sharegpt": (_CONVERSATIONS,),
    "specforge": (_CONVERSATIONS,),
}

REASON_NO_PROMPT: Final = 'no prompt: needs "input_ids" or "text"'
REASON_BAD_INPUT_IDS: Final = '"input_ids" must be a non-empty list of non-negative integers'
REASON_NO_USER_TURN: Final = "no user turn"


@dataclass(slots=True)
class Record:
    """One record, normalised: exactly one of ``input_ids``, ``text`` and ``turns`` is set."""

    sample_id: str
    #: ``input_ids``, ``text``, ``messages``, ``sharegpt`` or ``specforge``.
    shape: str
    meta: dict[str, Any]
    input_ids: list[int] | None = None
    text: str | None = None
    #: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``
    turns: list[dict[str, str]] | None = None


def derive_sample_id(obj: Mapping[str, Any]) -> str:
    """The id of a record without one: ``"h"`` + the first 16 hex digits of the sha1 of its canonical JSON.

    Canonical JSON is orjson with sorted keys, so the id depends only on the parsed content (not on key
    order or whitespace) and is the same on every run and machine. Identical records get identical ids.
    """
    canonical = orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)
    return "h" + hashlib.sha1(canonical).hexdigest()[:16]


def valid_input_ids(value: object) -> bool:
    # set(map(type, ...)) runs in C: bools, floats, strings, nulls and nested values all fail it.
    return isinstance(value, list) and len(value) > 0 and set(map(type, value)) == {int} and min(value) >= 0


def read_record(obj: dict[str, Any], fmt: str = "auto", id_field: str = "id") -> Record | str:
    """``obj`` as a `Record`, or the one-line reason it is not one. ``obj`` is not modified."""
    raw_id = obj.get(id_field)
    if raw_id is None:
        sample_id = derive_sample_id(obj)
    elif isinstance(raw_id, str):
        if not raw_id:
            return f'"{id_field}" must not be an empty string'
        sample_id = raw_id
    elif isinstance(raw_id, int) and not isinstance(raw_id, bool):
        sample_id = str(raw_id)
    else:
        return f'"{id_field}" must be a string or integer'

    keys = _KEYS[fmt]
    key = next((k for k in keys if obj.get(k) is not None), None)
    if key is None:
        return _no_prompt(fmt, keys)
    value = obj[key]
    meta = {k: v for k, v in obj.items() if k != id_field and k != key and not (k in keys and v is None)}

    if key == _INPUT_IDS:
        if not valid_input_ids(value):
            return REASON_BAD_INPUT_IDS
        return Record(sample_id, "input_ids", meta, input_ids=value)
    if key in (_TEXT, _PROMPT):
        if not isinstance(value, str) or not value:
            return f'"{key}" must be a non-empty string'
        return Record(sample_id, "text", meta, text=value)
    if key == _MESSAGES:
        turns = _role_turns(value, key)
        shape = "messages"
    else:
        shape = fmt if fmt in ("sharegpt", "specforge") else _conversations_shape(value)
        turns = _sharegpt_turns(value) if shape == "sharegpt" else _role_turns(value, key)
    if isinstance(turns, str):
        return turns
    if not any(t["role"] == "user" for t in turns):
        return f'"{key}": {REASON_NO_USER_TURN}'
    return Record(sample_id, shape, meta, turns=turns)


def _no_prompt(fmt: str, keys: tuple[str, ...]) -> str:
    if fmt == PLAIN:
        return REASON_NO_PROMPT
    named = ", ".join(f'"{k}"' for k in keys[:-1]) + f' or "{keys[-1]}"' if len(keys) > 1 else f'"{keys[0]}"'
    if fmt == "auto":
        return f"no prompt: needs {named}"
    article = "an" if fmt[0] in "aeiou" else "a"
    return f"not {article} {fmt} record: needs {named}"


def _conversations_shape(value: Any) -> str:
    """ShareGPT turns say ``from``/``value``; SpecForge turns say ``role``/``content``."""
    if isinstance(value, list) and value and isinstance(value[0], dict) and "role" in value[0]:
        return "specforge"
    return "sharegpt"


def _check_list(value: Any, key: str) -> str | None:
    if not isinstance(value, list) or not value:
        return f'"{key}" must be a non-empty list of turns'
    return None


def _role_turns(value: Any, key: str) -> list[dict[str, str]] | str:
    problem = _check_list(value, key)
    if problem:
        return problem
    turns = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict):
            return f'"{key}"[{i}]: not an object'
        role = turn.get("role")
        if not isinstance(role, str):
            return f'"{key}"[{i}]: needs a "role"'
        ours = _MESSAGE_ROLES.get(role)
        if ours is None:
            return f'"{key}"[{i}]: role "{role}" is not supported (only system, user and assistant turns)'
        content = _content(turn.get("content"))
        if content is None:
            return f'"{key}"[{i}]: "content" must be a string or a list of text parts'
        turns.append({"role": ours, "content": content})
    return turns


def _sharegpt_turns(value: Any) -> list[dict[str, str]] | str:
    key = _CONVERSATIONS
    problem = _check_list(value, key)
    if problem:
        return problem
    turns = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict):
            return f'"{key}"[{i}]: not an object'
        speaker = turn.get("from")
        if not isinstance(speaker, str):
            return f'"{key}"[{i}]: needs a "from" (a ShareGPT turn is {{"from", "value"}})'
        ours = _SHAREGPT_ROLES.get(speaker)
        if ours is None:
            return f'"{key}"[{i}]: "from": "{speaker}" is not supported (only system, human and gpt turns)'
        content = turn.get("value")
        if not isinstance(content, str):
            return f'"{key}"[{i}]: "value" must be a string'
        turns.append({"role": ours, "content": content})
    return turns


def _content(value: Any) -> str | None:
    """A turn's text: a string, or OpenAI's list of ``{"type": "text", "text"}`` parts joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value
    ):
        return "".join(p["text"] for p in value)
    return None
