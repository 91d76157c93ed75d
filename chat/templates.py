"""Chat records to exact prompt tokens, with the target model's own tokenizer and chat template.

A prompt is the template rendered as text (``apply_chat_template(..., tokenize=False,
add_generation_prompt=True)``) and then tokenized without adding special tokens (the template writes its
own BOS). That is how SpecForge tokenizes a ``conversations`` row for training, so the server sees the
tokens the trainer will see.

A conversation to generate is the record's turns in which each reply to generate is an assistant turn with
``"content": None`` (`REPLY`):

- ``regenerate = "last"`` drops the final assistant turn and generates it (a conversation that ends with a
  user turn gets a reply to it): one reply, whose prompt is known at submit.
- ``regenerate = "all"`` replaces every assistant turn (and answers a final user turn) in order; each
  reply's prompt holds the replies generated before it, so only the first is known at submit and the
  worker (`workers.conversation`) renders the others as it goes.

transformers is imported on first use: the plain ``input_ids`` / ``text`` path never loads it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Final

__all__ = [
    "REPLY",
    "ChatError",
    "ChatTokenizer",
    "count_replies",
    "load_chat_tokenizer",
    "plan_conversation",
    "prompt_messages",
]

#: A reply to generate, in a planned conversation.
REPLY: Final[Mapping[str, Any]] = {"role": "assistant", "content": None}

REASON_NOTHING_TO_ANSWER: Final = (
    "nothing to answer: without its final assistant turn the conversation must end with a user turn"
)


class ChatError(Exception):
    """A tokenizer that cannot be loaded or has no chat template."""


def _is_reply(turn: Mapping[str, Any]) -> bool:
    return turn.get("role") == "assistant" and turn.get("content") is None


def count_replies(conversation: Sequence[Mapping[str, Any]]) -> int:
    return sum(1 for t in conversation if _is_reply(t))


def plan_conversation(
    turns: Sequence[Mapping[str, str]], regenerate: str, system_prompt: str | None = None
) -> list[dict[str, Any]] | str:
    """The conversation to generate from a record's turns, or the reason the record cannot be one.

    ``system_prompt`` is put first unless the record has its own system turn (the record's wins).
    """
    conv: list[dict[str, Any]] = [dict(t) for t in turns]
    if system_prompt is not None and conv[0]["role"] != "system":
        conv.insert(0, {"role": "system", "content": system_prompt})
    if regenerate == "last":
        if conv[-1]["role"] == "assistant":
            conv.pop()
        if conv[-1]["role"] != "user":
            return REASON_NOTHING_TO_ANSWER
        conv.append(dict(REPLY))
        return conv
    first_user = next(i for i, t in enumerate(conv) if t["role"] == "user")
    if any(t["role"] == "assistant" for t in conv[:first_user]):
        return "an assistant turn comes before the first user turn: there is nothing it answers"
    planned = [dict(REPLY) if t["role"] == "assistant" else t for t in conv]
    if planned[-1]["role"] == "user":
        planned.append(dict(REPLY))
    for i in range(1, len(planned)):
        if _is_reply(planned[i]) and _is_reply(planned[i - 1]):
            return f"two assistant turns in a row (turns {i} and {i + 1}): each reply must answer a user turn"
    return planned


def prompt_messages(
    conversation: Sequence[Mapping[str, Any]], reply: int, replies: Sequence[str] = ()
) -> list[dict[str, str]]:
    """The messages before reply number ``reply`` (0-based), earlier replies filled from ``replies``."""
    messages: list[dict[str, str]] = []
    seen = 0
    for turn in conversation:
        if _is_reply(turn):
            if seen == reply:
                return messages
            messages.append({"role": "assistant", "content": replies[seen]})
            seen += 1
        else:
            messages.append({"role": str(turn["role"]), "content": str(turn["content"])})
    raise ValueError(f"the conversation has no reply number {reply}")


class ChatTokenizer:
    """A Hugging Face tokenizer with its chat template. Thread-safe (calls are serialised)."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        if not getattr(tokenizer, "chat_template", None):
            raise ChatError(f"tokenizer {name!r} has no chat template")

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        with self._lock:
            text: str = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt
            )
        return text

    def encode(self, text: str) -> list[int]:
        with self._lock:
            ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return list(ids)

    def prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The exact tokens of ``messages`` followed by the assistant's generation prompt.

        Raises `ValueError` with the template's message when the template refuses the messages (many
        raise on roles that do not alternate)."""
        try:
            text = self.render(messages)
        except Exception as exc:  # jinja2's TemplateError and whatever a template's raise_exception uses
            raise ValueError(f"chat template: {exc}") from None
        return self.encode(text)

    def reply_text(self, output_ids: Sequence[int], finish_reason: Mapping[str, Any] | None = None) -> str:
        """The text of a generated reply: its ids decoded without special tokens, and without the stop
        token or stop string that ended it (SGLang's ``text`` trims them too)."""
        ids = list(output_ids)
        finish = finish_reason or {}
        matched = finish.get("matched") if finish.get("type") == "stop" else None
        if isinstance(matched, int) and not isinstance(matched, bool) and ids and ids[-1] == matched:
            ids.pop()
        with self._lock:
            text: str = self.tokenizer.decode(ids, skip_special_tokens=True)
        if isinstance(matched, str) and matched and text.endswith(matched):
            text = text[: -len(matched)]
        return text


_loaded: dict[str, ChatTokenizer] = {}
_loading = threading.Lock()


def load_chat_tokenizer(name_or_path: str) -> ChatTokenizer:
    """The tokenizer at a local folder (or a model id already in the Hugging Face cache), loaded once per
    process. Raises `ChatError` with one line when it cannot be loaded."""
    with _loading:
        found = _loaded.get(name_or_path)
        if found is not None:
            return found
        # transformers prints an advice when PyTorch is missing; a tokenizer does not need it.
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ChatError(
                "chat records need the transformers package: pip install 'tokenfleet[eagle]'"
            ) from None
        try:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        except Exception as exc:  # OSError for a missing folder, ValueError for a bad one, hub errors
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ChatError(f"tokenizer {name_or_path!r} cannot be loaded: {first}") from None
        chat = ChatTokenizer(name_or_path, tokenizer)
        _loaded[name_or_path] = chat
        return chat
