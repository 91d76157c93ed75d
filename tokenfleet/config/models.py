"""The config's pydantic models, their validators and the constants they default to."""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Final, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    model_validator,
)
from pydantic_core import PydanticCustomError

from budget import defaults
from budget.urls import DEFAULT_REDIS_URL, redact_url
from producer.formats import Format
from tokenfleet.config.errors import _quote
from workers.sglang.protocol import (
    SAMPLING_PARAM_KEYS,
    sampling_param_errors,
    unknown_sampling_keys,
)

DEFAULT_OUTPUT_DIR: Final = "out"
DEFAULT_TIMEOUT_S: Final = defaults.TIMEOUT_S
DEFAULT_STALL_TIMEOUT_S: Final = defaults.STALL_TIMEOUT_S
DATASET_NAME_MAX_LEN: Final = 128

OnBudget = Literal["truncate", "discard", "drain"]
#: ``regenerate``: "last" generates a chat record's final assistant turn; "all" every assistant turn in
#: order, each with the replies generated before it as context (``docs/eagle3.md``).
Regenerate = Literal["last", "all"]
DEFAULT_ID_FIELD: Final = "id"
#: Keys a ``[[dataset]]`` inherits from the top level when it does not set them.
_INHERITED_KEYS: Final = ("tokenizer", "format", "id_field", "regenerate", "system_prompt")

_REDIS_SCHEMES: Final = ("redis", "rediss", "unix")
_SERVER_SCHEMES: Final = ("http", "https")
_NAME_RE: Final = defaults.DATASET_NAME_RE
#: Budgets and caps go through Redis INCRBY, a signed 64-bit integer.
_INT64_MAX: Final = 2**63 - 1

#: Names other APIs use for a sampling key, checked before fuzzy matching.
_SAMPLING_ALIASES: Final[Mapping[str, str]] = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "max_length": "max_new_tokens",
    "seed": "sampling_seed",
    "stop_sequences": "stop",
    "stop_ids": "stop_token_ids",
    "min_tokens": "min_new_tokens",
}

_SAMPLING_ERROR: Final = "tokenfleet_sampling"


def _suggest(word: str, choices: Iterable[str], aliases: Mapping[str, str] | None = None) -> str | None:
    if aliases and word in aliases:
        return aliases[word]
    matches = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    return matches[0] if matches else None


def _check_dataset_name(name: str) -> str:
    if not name:
        raise ValueError("must not be empty")
    if len(name) > DATASET_NAME_MAX_LEN:
        raise ValueError(f"must be at most {DATASET_NAME_MAX_LEN} characters (it has {len(name)})")
    if not _NAME_RE.fullmatch(name):
        raise ValueError(
            'must contain only letters, digits, "_", "." and "-" (it names a folder under output_dir)'
        )
    if name in (".", ".."):
        raise ValueError(f'must not be "{name}" (it names a folder under output_dir)')
    return name


def _json_problem(value: object) -> str | None:
    """Why ``value`` cannot go into a JSON request body, or None."""
    if value is None or isinstance(value, bool | int | str):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value} is not a finite number (JSON has no NaN/inf)"
    if isinstance(value, list):
        for item in value:
            problem = _json_problem(item)
            if problem:
                return problem
        return None
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                return f"object key {k!r} is not a string"
            problem = _json_problem(item)
            if problem:
                return problem
        return None
    return f"a {type(value).__name__} value cannot be sent as JSON"


def _sampling_error(message: str, key: str) -> PydanticCustomError:
    return PydanticCustomError(_SAMPLING_ERROR, "{detail}", {"detail": message, "key": key})


def _check_sampling(params: dict[str, Any]) -> dict[str, Any]:
    n = params.get("n", 1)
    if n != 1 or type(n) is not int:
        raise _sampling_error(
            f'sampling_params "n" = {_quote(n)}: tokenfleet writes one output per request; '
            "to get several samples of a prompt, list the prompt several times (each with its own id)",
            "n",
        )
    if params.get("beam_width") is not None:
        raise _sampling_error(
            'sampling_params "beam_width": beam search turns one request into a batch of beams; '
            "tokenfleet generates one sample per request, so it is not supported",
            "beam_width",
        )
    unknown = unknown_sampling_keys(params)
    if unknown:
        unknown_set = set(unknown)
        key = next(k for k in params if k in unknown_set)
        hint = "SGLang 0.5 rejects it on every request"
        suggestion = _suggest(key, SAMPLING_PARAM_KEYS, _SAMPLING_ALIASES)
        if suggestion:
            hint += f'; did you mean "{suggestion}"?'
        message = f'unknown sampling_params key "{key}" ({hint})'
        others = [k for k in params if k in unknown_set and k != key]
        if others:
            message += "; also unknown: " + ", ".join(f'"{k}"' for k in others)
        raise _sampling_error(message, key)
    for key, value in params.items():
        problem = _json_problem(value)
        if problem:
            raise _sampling_error(f'sampling_params "{key}": {problem}', key)
        # The server's request contract is type-strict (max_new_tokens = 100.0 is a 400 on every request).
        type_problems = sampling_param_errors({key: value})
        if type_problems and key != "max_new_tokens":  # max_new_tokens has its own message below
            raise _sampling_error(type_problems[0], key)
    if "max_new_tokens" in params:
        mnt = params["max_new_tokens"]
        if type(mnt) is not int or mnt < 1:
            raise _sampling_error(
                f'sampling_params "max_new_tokens" must be an integer >= 1, got {_quote(mnt)}',
                "max_new_tokens",
            )
    return params


def _check_server_urls(urls: list[str]) -> list[str]:
    normalized: list[str] = []
    for url in urls:
        shown = _quote(url)
        if not url or url != url.strip() or any(c.isspace() for c in url):
            raise ValueError(f"{shown} must not be empty or contain whitespace")
        try:
            parts = urlsplit(url)
            _ = parts.port  # raises ValueError on a bad port
        except ValueError as exc:
            raise ValueError(f"{shown} is not a valid URL ({exc})") from None
        if parts.scheme.lower() not in _SERVER_SCHEMES or not parts.hostname:
            raise ValueError(f"{shown} is not an http(s) URL like http://127.0.0.1:30000")
        if parts.query or parts.fragment or url.endswith(("?", "#")):
            raise ValueError(f"{shown} must not have a query or fragment")
        url = url.rstrip("/")
        if url in normalized:
            raise ValueError(f"{_quote(url)} is listed twice")
        normalized.append(url)
    return normalized


def check_redis_url(url: str) -> str:
    scheme, sep, _rest = url.partition("://")
    if not sep or not scheme:
        raise ValueError(f"{_quote(url)} is not a URL like {DEFAULT_REDIS_URL}")
    if scheme.lower() not in _REDIS_SCHEMES:
        raise ValueError(f'unsupported scheme "{scheme}" (use redis://, rediss:// or unix://)')
    return url


def _check_unique_names(names: Sequence[str]) -> int | None:
    """Index of the first name that repeats an earlier one (ignoring case), or None."""
    seen: set[str] = set()
    for i, name in enumerate(names):
        folded = name.casefold()
        if folded in seen:
            return i
        seen.add(folded)
    return None


DatasetName = Annotated[str, Strict(), AfterValidator(_check_dataset_name)]
PositiveInt = Annotated[int, Strict(), Field(ge=1, le=_INT64_MAX)]
SamplingParams = Annotated[dict[str, Any], AfterValidator(_check_sampling)]
ServerUrls = Annotated[list[str], Field(min_length=1), AfterValidator(_check_server_urls)]
RedisUrl = Annotated[str, Strict(), AfterValidator(check_redis_url)]
Timeout = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]
NonEmptyStr = Annotated[str, Strict(), Field(min_length=1)]


# ------------------------------------------------------------------------------------------- models


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerKeys(_Model):
    """Where every process finds a server's API keys: an environment variable (``*_env``) or a secret
    file (``*_file``), read by the submit and by each worker on its own machine. The keys themselves are
    never written to the config, Redis, records, status or logs."""

    #: ``--api-key`` of the servers: sent as ``Authorization: Bearer <key>``.
    api_key_env: NonEmptyStr | None = None
    api_key_file: NonEmptyStr | None = None
    #: ``--admin-api-key``: the only key ``/abort_request`` accepts when the server has one.
    admin_api_key_env: NonEmptyStr | None = None
    admin_api_key_file: NonEmptyStr | None = None

    @model_validator(mode="after")
    def _one_source_each(self) -> ServerKeys:
        for what in ("api_key", "admin_api_key"):
            if getattr(self, f"{what}_env") and getattr(self, f"{what}_file"):
                raise ValueError(f"set one of {what}_env and {what}_file, not both")
        return self

    def refs(self) -> dict[str, dict[str, str]]:
        """The spec's form: ``{"api_key": {"env": NAME} | {"file": PATH}, ...}`` (names, never keys)."""
        out: dict[str, dict[str, str]] = {}
        for what in ("api_key", "admin_api_key"):
            env, file = getattr(self, f"{what}_env"), getattr(self, f"{what}_file")
            if env:
                out[what] = {"env": env}
            elif file:
                out[what] = {"file": file}
        return out


class ServerConfig(ServerKeys):
    """``[server]``: the SGLang servers to spread requests over."""

    urls: ServerUrls
    timeout_s: Timeout = DEFAULT_TIMEOUT_S
    #: A stream that sends nothing for this long (before its first chunk, or between two) is stalled: it
    #: is aborted and retried on another server, and the server gets no new work until a real generation
    #: succeeds there. A few times the longest normal gap: a long prefill on a busy server.
    stall_timeout_s: Timeout = DEFAULT_STALL_TIMEOUT_S
    max_inflight_per_server: PositiveInt | None = None
    #: The model's vocabulary size, only when submit cannot learn it from the servers (their
    #: ``/model_info`` names a model folder whose ``config.json`` is not readable here).
    vocab_size: PositiveInt | None = None
    #: Per-server keys overriding the ones above: ``[server.keys."http://host:30000"]``.
    keys: dict[str, ServerKeys] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _keys_name_listed_servers(self) -> ServerConfig:
        for url in self.keys:
            if url.rstrip("/") not in self.urls:
                raise ValueError(f'[server.keys."{url}"]: not one of server.urls')
        return self

    def auth_refs(self) -> dict[str, dict[str, dict[str, str]]]:
        """Each server's key sources (see `ServerKeys.refs`); servers without keys are left out."""
        keys = {url.rstrip("/"): k for url, k in self.keys.items()}
        refs = {url: keys.get(url, self).refs() for url in self.urls}
        return {url: r for url, r in refs.items() if r}

    def __repr_args__(self) -> Iterable[tuple[str | None, Any]]:
        for name, value in super().__repr_args__():
            yield name, ([redact_url(u) for u in value] if name == "urls" else value)


class RetryConfig(_Model):
    """``[retry]``: how a worker retries 5xx answers, dropped streams and server-side aborts of a sample
    (each attempt with a new rid) before it marks the sample failed. Backoff is exponential with full
    jitter: a random wait in ``[0, min(backoff_cap_s, backoff_base_s * 2**n)]``."""

    max_attempts: Annotated[int, Strict(), Field(ge=1, le=100)] = defaults.MAX_ATTEMPTS
    backoff_base_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = defaults.BACKOFF_BASE_S
    backoff_cap_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = defaults.BACKOFF_CAP_S
    #: A task's last attempt comes no sooner than this after its first (a server restart costs no strike).
    min_span_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = defaults.RETRY_MIN_SPAN_S


#: ``fsync``: "always" flushes each record to disk before the ledger counts it (a host crash loses
#: nothing counted); "never" leaves it in the OS page cache (a killed process still loses nothing).
FsyncPolicy = Literal["always", "never"]


class DatasetConfig(_Model):
    """One ``[[dataset]]``. After `load_config`, ``path`` is absolute and ``sampling`` is the merged,
    effective ``sampling_params`` (``[sampling]`` then ``[dataset.sampling]``, with ``max_new_tokens``
    always present)."""

    name: DatasetName
    path: Path
    token_budget: PositiveInt | None = None
    max_samples: PositiveInt | None = None
    on_budget: OnBudget = defaults.ON_BUDGET
    sampling: SamplingParams = Field(default_factory=dict)
    #: The target model's tokenizer: an absolute folder, or a model id in the Hugging Face cache.
    tokenizer: str | None = None
    format: Format = "auto"
    id_field: str = DEFAULT_ID_FIELD
    regenerate: Regenerate = defaults.REGENERATE
    system_prompt: str | None = None


class FleetConfig(_Model):
    """The whole config. After `load_config` every path is absolute."""

    redis_url: RedisUrl = DEFAULT_REDIS_URL
    output_dir: Path
    server: ServerConfig
    sampling: SamplingParams = Field(default_factory=dict)
    datasets: list[DatasetConfig] = Field(min_length=1)
    source_path: Path
    retry: RetryConfig = Field(default_factory=RetryConfig)
    fsync: FsyncPolicy = defaults.FSYNC
    #: Samples per Celery message; a worker runs a message's samples at once, each on its own. "auto"
    #: (the default): sized at each publish from the servers' caps and the worker threads online
    #: (``tokenfleet.publish.GroupSizer``).
    samples_per_task: Annotated[int, Strict(), Field(ge=1, le=64)] | Literal["auto"] = "auto"

    @model_validator(mode="after")
    def _names_are_unique(self) -> FleetConfig:
        dup = _check_unique_names([d.name for d in self.datasets])
        if dup is not None:
            raise ValueError(f'dataset name "{self.datasets[dup].name}" is used twice (names ignore case)')
        return self

    def get_dataset(self, name: str) -> DatasetConfig:
        """The dataset called ``name``; KeyError if there is none."""
        for dataset in self.datasets:
            if dataset.name == name:
                return dataset
        raise KeyError(name)

    def __repr_args__(self) -> Iterable[tuple[str | None, Any]]:
        for name, value in super().__repr_args__():
            yield name, (redact_url(value) if name == "redis_url" else value)


class _DatasetTable(_Model):
    """A ``[[dataset]]`` table as written in the file."""

    name: DatasetName
    path: Annotated[str, Strict(), Field(min_length=1)]
    token_budget: PositiveInt | None = None
    max_samples: PositiveInt | None = None
    on_budget: OnBudget = defaults.ON_BUDGET
    sampling: SamplingParams = Field(default_factory=dict)
    # None: inherited from the top level.
    tokenizer: NonEmptyStr | None = None
    format: Format | None = None
    id_field: NonEmptyStr | None = None
    regenerate: Regenerate | None = None
    system_prompt: Annotated[str, Strict()] | None = None


class _ConfigFile(_Model):
    """The TOML document as written."""

    redis_url: RedisUrl = DEFAULT_REDIS_URL
    output_dir: Annotated[str, Strict(), Field(min_length=1)] = DEFAULT_OUTPUT_DIR
    server: ServerConfig
    sampling: SamplingParams = Field(default_factory=dict)
    dataset: list[_DatasetTable] = Field(min_length=1)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    fsync: FsyncPolicy = defaults.FSYNC
    #: Samples per Celery message; a worker runs a message's samples at once, each on its own. "auto"
    #: (the default): sized at each publish from the servers' caps and the worker threads online
    #: (``tokenfleet.publish.GroupSizer``).
    samples_per_task: Annotated[int, Strict(), Field(ge=1, le=64)] | Literal["auto"] = "auto"
    tokenizer: NonEmptyStr | None = None
    format: Format = "auto"
    id_field: NonEmptyStr = DEFAULT_ID_FIELD
    regenerate: Regenerate = defaults.REGENERATE
    system_prompt: Annotated[str, Strict()] | None = None
