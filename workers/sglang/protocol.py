"""Facts of SGLang's native ``/generate`` protocol (sglang 0.5.x), shared by the client and the simulator.

Source: ``shared/reference/sglang-http.md``. Keep every literal of the wire format here so the client
(`workers.sglang.client`) and the simulator (`tokenfleet.sim`) cannot drift apart.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final, Literal, TypedDict


class ParamType(enum.Enum):
    """What JSON value a ``sampling_params`` key takes (``null`` always means "the default")."""

    INT = "i64"
    FLOAT = "f64"  # an int is accepted too
    BOOL = "a boolean"
    STR = "a string"
    STR_OR_LIST = "a string or a list of strings"
    INT_LIST = "a list of integers"
    STR_LIST = "a list of strings"
    FLOAT_MAP = "a map of numbers"
    WATERMARK = "a watermark object"
    ANY = "any value"


#: ``sampling_params`` keys sglang 0.5.23 accepts and their types, in the order its 400 text lists them
#: (``sglang/api/v1/api_types.py``). Any other key, or a value of the wrong type, is a 400 on every request.
SAMPLING_PARAM_TYPES: Final[Mapping[str, ParamType]] = MappingProxyType(
    {
        "max_new_tokens": ParamType.INT,
        "stop": ParamType.STR_OR_LIST,
        "stop_token_ids": ParamType.INT_LIST,
        "stop_regex": ParamType.STR_OR_LIST,
        "temperature": ParamType.FLOAT,
        "top_p": ParamType.FLOAT,
        "top_k": ParamType.INT,
        "min_p": ParamType.FLOAT,
        "frequency_penalty": ParamType.FLOAT,
        "presence_penalty": ParamType.FLOAT,
        "repetition_penalty": ParamType.FLOAT,
        "min_new_tokens": ParamType.INT,
        "n": ParamType.INT,
        "json_schema": ParamType.STR,
        "regex": ParamType.STR,
        "ebnf": ParamType.STR,
        "structural_tag": ParamType.STR,
        "ignore_eos": ParamType.BOOL,
        "skip_special_tokens": ParamType.BOOL,
        "spaces_between_special_tokens": ParamType.BOOL,
        "no_stop_trim": ParamType.BOOL,
        "stream_interval": ParamType.INT,
        "logit_bias": ParamType.FLOAT_MAP,
        "sampling_seed": ParamType.INT,
        "custom_params": ParamType.ANY,
        "beam_width": ParamType.INT,
        "watermark": ParamType.WATERMARK,
        "choice": ParamType.STR_LIST,
    }
)

#: The keys alone.
SAMPLING_PARAM_KEYS: Final[frozenset[str]] = frozenset(SAMPLING_PARAM_TYPES)

#: Keys of the ``watermark`` object and their types.
WATERMARK_KEYS: Final[Mapping[str, ParamType]] = MappingProxyType(
    {"enabled": ParamType.BOOL, "key": ParamType.STR, "context_window": ParamType.INT}
)


#: SGLang's own default for ``max_new_tokens`` (128): we always send one explicitly.
SGLANG_DEFAULT_MAX_NEW_TOKENS: Final = 128

#: Path of each endpoint.
GENERATE_PATH: Final = "/generate"
ABORT_PATH: Final = "/abort_request"
#: ``{"prompt": text}`` -> ``{"tokens": [...], "count": n, "max_model_len": m}``: the server's tokenizer
#: (0.5.23, observed: the ids its ``/generate`` saw for the same ``text``).
TOKENIZE_PATH: Final = "/tokenize"
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

#: Length of our request ids: ``uuid4().hex``. Fixed length matters: ``/abort_request`` needs an exact,
#: live rid, and then the scheduler also aborts every live rid that starts with it.
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
    #: Of completion_tokens, those a reasoning model spent thinking (observed in every chunk; 0 when none).
    reasoning_tokens: int
    e2e_latency: float


class GenerateResponse(TypedDict, total=False):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo


def unknown_sampling_keys(sampling_params: Mapping[str, Any]) -> list[str]:
    """The keys of ``sampling_params`` that SGLang 0.5 rejects, sorted."""
    return sorted(k for k in sampling_params if k not in SAMPLING_PARAM_KEYS)


def unknown_sampling_key_error(key: str) -> str:
    """The 400 body text SGLang 0.5.23 returns for an unknown sampling key (keys in its own order)."""
    return _unknown_field(key, tuple(SAMPLING_PARAM_TYPES))


def _unknown_field(key: str, expected: tuple[str, ...]) -> str:
    listed = ", ".join(f"`{k}`" for k in expected)
    return f"unknown field `{key}`, expected one of {listed}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe_value(value: Any) -> str:
    """How SGLang's 400 text names a JSON value (serde's wording)."""
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    if isinstance(value, list | tuple):
        return "sequence"
    if isinstance(value, Mapping):
        return "map"
    return type(value).__name__


def _invalid_type(value: Any, expected: str) -> str:
    return f"invalid type: {_describe_value(value)}, expected {expected}"


def _scalar_error(value: Any, kind: ParamType) -> str | None:
    accepted = {
        ParamType.INT: _is_int(value),
        ParamType.FLOAT: _is_int(value) or isinstance(value, float),
        ParamType.BOOL: isinstance(value, bool),
        ParamType.STR: isinstance(value, str),
    }[kind]
    return None if accepted else _invalid_type(value, kind.value)


def _list_error(value: Any, item: ParamType) -> str | None:
    if not isinstance(value, list | tuple):
        return _invalid_type(value, "a sequence")
    return next((e for e in (_scalar_error(v, item) for v in value) if e), None)


def sampling_param_type_error(key: str, value: Any) -> str | None:
    """SGLang's 400 text for ``value`` under a known ``key`` (serde's wording), or None when it fits."""
    kind = SAMPLING_PARAM_TYPES[key]
    if value is None or kind is ParamType.ANY:
        return None
    if kind in (ParamType.INT, ParamType.FLOAT, ParamType.BOOL, ParamType.STR):
        return _scalar_error(value, kind)
    if kind is ParamType.STR_OR_LIST:
        if isinstance(value, list | tuple):
            return _list_error(value, ParamType.STR)
        return None if isinstance(value, str) else _invalid_type(value, kind.value)
    if kind is ParamType.INT_LIST:
        return _list_error(value, ParamType.INT)
    if kind is ParamType.STR_LIST:
        return _list_error(value, ParamType.STR)
    if not isinstance(value, Mapping):
        return _invalid_type(value, "a map")
    if kind is ParamType.FLOAT_MAP:
        return next((e for e in (_scalar_error(v, ParamType.FLOAT) for v in value.values()) if e), None)
    for sub_key, sub_value in value.items():  # the watermark object
        if sub_key not in WATERMARK_KEYS:
            return _unknown_field(sub_key, tuple(WATERMARK_KEYS))
        error = None if sub_value is None else _scalar_error(sub_value, WATERMARK_KEYS[sub_key])
        if error:
            return error
    return None


def sampling_param_server_error(params: Mapping[str, Any]) -> str | None:
    """The 400 text SGLang 0.5.23 answers for these ``sampling_params`` (the first problem), or None."""
    for key, value in params.items():
        if key not in SAMPLING_PARAM_TYPES:
            return unknown_sampling_key_error(key)
        error = sampling_param_type_error(key, value)
        if error:
            return error
    return None


def sampling_param_errors(params: Mapping[str, Any]) -> list[str]:
    """Every problem SGLang 0.5.23 would refuse ``params`` for, one readable line each: an unknown key,
    or a value of the wrong type (a bool is not an integer; an integer is accepted where a float is;
    ``null`` means the default). Empty when the server accepts them."""
    problems = []
    for key, value in params.items():
        if key not in SAMPLING_PARAM_TYPES:
            problems.append(f"unknown sampling_params key `{key}`")
            continue
        error = sampling_param_type_error(key, value)
        if error:
            kind = SAMPLING_PARAM_TYPES[key]
            problems.append(f"sampling_params `{key}` must be {_readable(kind)} ({error})")
    return problems


def _readable(kind: ParamType) -> str:
    return {
        ParamType.INT: "an integer",
        ParamType.FLOAT: "a number",
        ParamType.BOOL: "true or false",
    }.get(kind, kind.value)


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
MODELS_PATH: Final = "/v1/models"
#: Load per data-parallel rank (``/get_load`` is gone in 0.5.23: 404).
LOADS_PATH: Final = "/v1/loads"
READY_PATH: Final = "/ready"
PING_PATH: Final = "/ping"
METRICS_PATH: Final = "/metrics"
#: Routes open without a key when the server runs with ``--api-key`` (matched by prefix, as SGLang does).
OPEN_PATH_PREFIXES: Final = ("/health", "/ready", "/metrics")
UNAUTHORIZED_BODY: Final = {"error": "Unauthorized"}

#: ``finish_reason.err_type`` of an abort for the input's fault (``status_code`` 400).
ERR_TYPE_BAD_REQUEST: Final = "BadRequestError"
#: Abort messages of a request the server sheds (``status_code`` 503).
QUEUE_FULL_MESSAGE: Final = "The request queue is full."
WAITING_TIMEOUT_MESSAGE: Final = "Request waiting timeout reached."
RUNNING_TIMEOUT_MESSAGE: Final = "Request running timeout reached."
#: The rid prefix of the 1-token generation a ``/health`` call runs.
HEALTH_CHECK_RID_PREFIX: Final = "HEALTH_CHECK"

#: 400 ``{"error": {"message": ...}}`` when a request carries no prompt at all.
MISSING_PROMPT_ERROR: Final = "Either text, input_ids or input_embeds should be provided."
#: 400 ``{"error": {"message": ...}}`` for ``input_ids: []``.
EMPTY_INPUT_IDS_ERROR: Final = "input_ids cannot be empty."


def duplicate_rid_error(rid: str) -> str:
    """The 400 message for a ``rid`` that is still in flight."""
    return f"Duplicate request ID detected: {rid}"


def input_too_long_error(prompt_tokens: int, max_req_input_len: int) -> str:
    """The abort message for a prompt over the scheduler's ``max_req_input_len``."""
    return (
        f"Input length ({prompt_tokens} tokens) exceeds the maximum allowed length "
        f"({max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate."
    )


def stream_error_chunk(message: str, code: int = 400) -> dict[str, Any]:
    """What a 200 stream carries instead of chunks when the request is refused before it runs."""
    return {"error": {"message": message, "type": "invalid_request_error", "code": code, "retryable": False}}


def overloaded_error_body(message: str) -> dict[str, Any]:
    """The 503 body SGLang sends when it sheds load (queue full, waiting or running timeout)."""
    return {"object": "error", "message": message, "code": 503}
