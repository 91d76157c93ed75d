"""Facts of SGLang's native ``/generate`` protocol (sglang 0.5.x), shared by the client and the simulator.

Source: ``shared/reference/sglang-http.md``. Keep every literal of the wire format here so the client
(`workers.sglang.client`) and the simulator (`tokenfleet.sim`) cannot drift apart.
"""

from __future__ import annotations

from typing import Any, Final, Literal, TypedDict

#: ``sampling_params`` keys sglang 0.5.23 accepts; any other key is a 400 on *every* request.
SAMPLING_PARAM_KEYS: Final[frozenset[str]] = frozenset(
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
        "custom_params",
    }
)

#: SGLang's own default for ``max_new_tokens`` (128): we always send one explicitly.
SGLANG_DEFAULT_MAX_NEW_TOKENS: Final = 128

#: Path of each endpoint.
GENERATE_PATH: Final = "/generate"
ABORT_PATH: Final = "/abort_request"
HEALTH_PATH: Final = "/health"
MODEL_INFO_PATH: Final = "/model_info"
SERVER_INFO_PATH: Final = "/server_info"
#: The deprecated spelling, still served by sglang and the only one sglang-router 0.3 answers.
GET_SERVER_INFO_PATH: Final = "/get_server_info"

#: Server-sent events framing of a streaming ``/generate``.
SSE_DATA_PREFIX: Final = b"data: "
SSE_DONE: Final = b"[DONE]"

#: ``finish_reason.type`` values.
FinishType = Literal["length", "stop", "abort"]
FINISH_LENGTH: Final = "length"
FINISH_STOP: Final = "stop"
FINISH_ABORT: Final = "abort"

#: ``finish_reason.message`` of an abort.
ABORT_MESSAGE_REQUESTED: Final = "Aborted"
ABORT_MESSAGE_WAITING_QUEUE: Final = "Abort in waiting queue"

#: Length of our request ids: ``uuid4().hex``. Fixed length matters: ``/abort_request`` matches by prefix.
RID_LENGTH: Final = 32


class FinishReason(TypedDict, total=False):
    type: str
    length: int
    matched: int | str | None
    message: str
    status_code: int | None
    err_type: str | None


class MetaInfo(TypedDict, total=False):
    id: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    num_retractions: int
    e2e_latency: float


class GenerateResponse(TypedDict, total=False):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo


def unknown_sampling_keys(sampling_params: dict[str, Any]) -> list[str]:
    """The keys of ``sampling_params`` that SGLang 0.5 rejects, sorted."""
    return sorted(k for k in sampling_params if k not in SAMPLING_PARAM_KEYS)


def unknown_sampling_key_error(key: str) -> str:
    """The 400 body text SGLang 0.5.23 returns for an unknown sampling key."""
    expected = ", ".join(f"`{k}`" for k in sorted(SAMPLING_PARAM_KEYS))
    return f"unknown field `{key}`, expected one of {expected}"


def context_length_error(prompt_tokens: int, context_length: int) -> str:
    return (
        f"The input ({prompt_tokens} tokens) is longer than the model's context length "
        f"({context_length} tokens)."
    )


def context_overflow_error(prompt_tokens: int, max_new_tokens: int, context_length: int) -> str:
    return (
        "Requested token count exceeds the model's maximum context length of "
        f"{context_length} tokens. You requested a total of {prompt_tokens + max_new_tokens} tokens: "
        f"{prompt_tokens} tokens from the input messages and {max_new_tokens} tokens for the completion."
    )


def is_abort(finish_reason: FinishReason | None) -> bool:
    return bool(finish_reason) and finish_reason.get("type") == FINISH_ABORT  # type: ignore[union-attr]


# Used by the simulator (tokenfleet.sim); the client may match on them too.
HEALTH_GENERATE_PATH: Final = "/health_generate"
GET_LOAD_PATH: Final = "/get_load"
MODELS_PATH: Final = "/v1/models"

#: 400 ``{"error": {"message": ...}}`` when a request carries no prompt at all.
MISSING_PROMPT_ERROR: Final = "Either text, input_ids or input_embeds should be provided."


def duplicate_rid_error(rid: str) -> str:
    """The 400 message for a ``rid`` that is still in flight."""
    return f"Duplicate request ID detected: {rid}"


def overloaded_error_body(message: str) -> dict[str, Any]:
    """The 503 body SGLang sends when it sheds load (queue full, waiting or running timeout)."""
    return {"object": "error", "message": message, "code": 503}
