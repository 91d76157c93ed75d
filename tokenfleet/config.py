"""The user's TOML config, validated with pydantic v2.

Every table forbids unknown keys, so a typo is an error rather than a silently ignored setting. Every
problem surfaces as one `ConfigError` line naming the file and, when it can be found, the line::

    config.toml:14: dataset "x": unknown sampling_params key "max_tokens" (SGLang 0.5 rejects it on
    every request; did you mean "max_new_tokens"?)

Example::

    redis_url = "redis://127.0.0.1:6379/0"   # env TOKENFLEET_REDIS_URL overrides it
    output_dir = "out"                        # relative paths resolve against this file's folder

    [server]
    urls = ["http://127.0.0.1:30000"]
    timeout_s = 1800

    [sampling]                                # sent as sampling_params
    max_new_tokens = 4096
    temperature = 0.7

    [[dataset]]
    name = "B2_opencodeinstruct"
    path = "data/b2.jsonl"
    token_budget = 10_000_000                 # completion tokens; absent = no budget
    max_samples = 7000                        # absent = no cap
    on_budget = "truncate"                    # "truncate" | "discard" | "drain"
    [dataset.sampling]                        # overrides [sampling] for this dataset
    temperature = 0.2
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import os
import re
import tomllib
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
    ValidationError,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from budget import defaults
from budget.urls import DEFAULT_REDIS_URL, REDIS_URL_ENV, redact_url
from producer.formats import Format
from producer.source import SourceError, check_source
from workers.sglang.protocol import (
    SAMPLING_PARAM_KEYS,
    SGLANG_DEFAULT_MAX_NEW_TOKENS,
    sampling_param_errors,
    unknown_sampling_keys,
)

__all__ = [
    "DATASET_NAME_MAX_LEN",
    "DEFAULT_OUTPUT_DIR",
    "DEFAULT_REDIS_URL",
    "DEFAULT_STALL_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "REDIS_URL_ENV",
    "ConfigError",
    "DatasetConfig",
    "FleetConfig",
    "FsyncPolicy",
    "OnBudget",
    "RetryConfig",
    "ServerConfig",
    "load_config",
    "redact_url",
]

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


# --------------------------------------------------------------------------------------------- errors


class ConfigError(Exception):
    """A config problem. ``str()`` is one user-facing line: ``file:LINE: message``.

    ``file`` and ``line`` are optional: without a line it is ``file: message``, without a file just the
    message.
    """

    def __init__(
        self,
        message: str,
        *,
        file: str | os.PathLike[str] | None = None,
        line: int | None = None,
    ) -> None:
        self.message = " ".join(message.split())
        self.file = os.fspath(file) if file is not None else None
        self.line = line
        super().__init__(self._render())

    def _render(self) -> str:
        if self.file is None:
            return self.message
        if self.line is None:
            return f"{self.file}: {self.message}"
        return f"{self.file}:{self.line}: {self.message}"

    def __str__(self) -> str:
        return self._render()


# ------------------------------------------------------------------------------------------ redaction

# ------------------------------------------------------------------------------------------ validators


def _quote(value: object) -> str:
    """A value as the user would write it in TOML/JSON, credentials masked."""
    if isinstance(value, str):
        return json.dumps(redact_url(value), ensure_ascii=False)
    return json.dumps(value) if isinstance(value, bool | int | float) or value is None else repr(value)


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


def _check_redis_url(url: str) -> str:
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
RedisUrl = Annotated[str, Strict(), AfterValidator(_check_redis_url)]
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
    #: Samples per Celery message. 1 (the default) for long answers; a few (4-8) for short ones, where
    #: the cost of a message weighs: a worker runs a message's samples at once, each on its own.
    samples_per_task: Annotated[int, Strict(), Field(ge=1, le=64)] = 1

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
    #: Samples per Celery message. 1 (the default) for long answers; a few (4-8) for short ones, where
    #: the cost of a message weighs: a worker runs a message's samples at once, each on its own.
    samples_per_task: Annotated[int, Strict(), Field(ge=1, le=64)] = 1
    tokenizer: NonEmptyStr | None = None
    format: Format = "auto"
    id_field: NonEmptyStr = DEFAULT_ID_FIELD
    regenerate: Regenerate = defaults.REGENERATE
    system_prompt: Annotated[str, Strict()] | None = None


# ---------------------------------------------------------------------------------------- load_config


def load_config(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> FleetConfig:
    """Read, validate and resolve the TOML config at ``path``; raise `ConfigError` on any problem.

    ``env`` (default ``os.environ``): a non-empty ``TOKENFLEET_REDIS_URL`` replaces ``redis_url``.
    Relative paths resolve against the config file's folder.
    """
    env = os.environ if env is None else env
    shown = os.fspath(path)
    config_path = Path(path).expanduser()
    text = _read_text(config_path, shown)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _toml_syntax_error(exc, shown) from None

    locator = _KeyLocator(text)
    try:
        doc = _ConfigFile.model_validate(raw)
    except ValidationError as exc:
        raise _translate(exc, raw, locator, shown) from None

    dup = _check_unique_names([d.name for d in doc.dataset])
    if dup is not None:
        first = next(
            i for i, d in enumerate(doc.dataset) if d.name.casefold() == doc.dataset[dup].name.casefold()
        )
        first_line = locator.line(("dataset", first, "name"))
        where = f" at line {first_line}" if first_line else ""
        raise ConfigError(
            f'dataset "{doc.dataset[dup].name}": name already used by dataset #{first + 1}{where} '
            "(names must be unique, ignoring case: each names a folder under output_dir)",
            file=shown,
            line=locator.line(("dataset", dup, "name")),
        )

    base = config_path.absolute().parent
    output_dir = _resolve(base, doc.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(
            f'output_dir "{doc.output_dir}" exists and is not a directory ({output_dir})',
            file=shown,
            line=locator.line(("output_dir",)),
        )

    datasets: list[dict[str, Any]] = []
    for i, table in enumerate(doc.dataset):
        dataset_path = _resolve(base, table.path)
        try:
            check_source(dataset_path)
        except SourceError as exc:
            resolved = "" if Path(table.path).is_absolute() else f" (resolved to {dataset_path})"
            raise ConfigError(
                f'dataset "{table.name}": path "{table.path}": {exc.reason}{resolved}',
                file=shown,
                line=locator.line(("dataset", i, "path")),
            ) from None
        sampling = copy.deepcopy(doc.sampling)
        sampling.update(copy.deepcopy(table.sampling))
        sampling.setdefault("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS)
        sampling.setdefault("stream_interval", defaults.STREAM_INTERVAL)  # the effective sampling
        datasets.append(
            {
                "name": table.name,
                "path": dataset_path,
                "token_budget": table.token_budget,
                "max_samples": table.max_samples,
                "on_budget": table.on_budget,
                "sampling": sampling,
                **_prompt_keys(doc, i, base, locator, shown),
            }
        )

    redis_url = doc.redis_url
    override = env.get(REDIS_URL_ENV, "").strip()
    if override:
        try:
            redis_url = _check_redis_url(override)
        except ValueError as exc:
            raise ConfigError(str(exc), file=REDIS_URL_ENV) from None

    try:
        return FleetConfig(
            redis_url=redis_url,
            output_dir=output_dir,
            server=doc.server,
            sampling=doc.sampling,
            datasets=[DatasetConfig(**d) for d in datasets],
            source_path=config_path.absolute(),
            retry=doc.retry,
            fsync=doc.fsync,
            samples_per_task=doc.samples_per_task,
        )
    except ValidationError as exc:  # pragma: no cover - the file model checked all of it already
        raise _translate(exc, raw, locator, shown) from None


def _prompt_keys(doc: _ConfigFile, i: int, base: Path, locator: _KeyLocator, shown: str) -> dict[str, Any]:
    """Dataset ``i``'s tokenizer, format, id_field, regenerate and system_prompt: its own, else the top
    level's. A tokenizer that names an existing folder (relative to the config's folder) becomes absolute;
    anything else that does not look like a path is a model id for the Hugging Face cache."""
    table = doc.dataset[i]
    keys = {k: v if (v := getattr(table, k)) is not None else getattr(doc, k) for k in _INHERITED_KEYS}

    def line(key: str) -> int | None:
        own = getattr(table, key) is not None
        return locator.line(("dataset", i, key) if own else (key,))

    tokenizer = keys["tokenizer"]
    if tokenizer is not None:
        folder = _resolve(base, tokenizer)
        if folder.is_dir():
            keys["tokenizer"] = str(folder)
        elif folder.exists() or tokenizer.startswith(("/", ".", "~")):
            what = "is not a folder" if folder.exists() else "no such folder"
            raise ConfigError(
                f'dataset "{table.name}": tokenizer "{tokenizer}": {what} ({folder})',
                file=shown,
                line=line("tokenizer"),
            )
    if keys["system_prompt"] is not None and tokenizer is None:
        raise ConfigError(
            f'dataset "{table.name}": system_prompt needs a tokenizer '
            "(the prompt is written with the model's chat template)",
            file=shown,
            line=line("system_prompt"),
        )
    return keys


def _read_text(config_path: Path, shown: str) -> str:
    try:
        data = config_path.read_bytes()
    except FileNotFoundError:
        raise ConfigError("no such file", file=shown) from None
    except IsADirectoryError:
        raise ConfigError("is a directory, not a file", file=shown) from None
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror or exc.__class__.__name__}", file=shown) from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError("invalid TOML: not valid UTF-8", file=shown, line=line) from None


def _resolve(base: Path, value: str) -> Path:
    p = Path(value).expanduser()
    return (p if p.is_absolute() else base / p).resolve()


_TOML_POSITION_RE: Final = re.compile(r"^(?P<msg>.*?)\s*\(at line (?P<line>\d+), column (?P<col>\d+)\)$")


def _toml_syntax_error(exc: tomllib.TOMLDecodeError, shown: str) -> ConfigError:
    text = str(exc)
    line = getattr(exc, "lineno", None)
    col = getattr(exc, "colno", None)
    msg = getattr(exc, "msg", None)
    m = _TOML_POSITION_RE.match(text)
    if m:
        line, col, msg = int(m["line"]), int(m["col"]), m["msg"]
    if not isinstance(line, int) or not isinstance(msg, str):
        return ConfigError(f"invalid TOML: {_lower_first(text)}", file=shown)
    where = f" (column {col})" if isinstance(col, int) else ""
    return ConfigError(f"invalid TOML: {_lower_first(msg)}{where}", file=shown, line=line)


def _lower_first(s: str) -> str:
    return s[:1].lower() + s[1:] if s[:2] != s[:2].upper() else s


# --------------------------------------------------------------------------- pydantic error translation

Loc = tuple[str | int, ...]

_TOP_LEVEL_KEYS: Final = frozenset(_ConfigFile.model_fields)
_TABLE_KEYS: Final[Mapping[Loc, frozenset[str]]] = {
    (): _TOP_LEVEL_KEYS,
    ("server",): frozenset(ServerConfig.model_fields),
}
_DATASET_KEYS: Final = frozenset(_DatasetTable.model_fields)


def _translate(exc: ValidationError, raw: Mapping[str, Any], locator: _KeyLocator, shown: str) -> ConfigError:
    errors = exc.errors(include_url=False)
    message, line_loc = _describe(errors[0], raw)
    if len(errors) > 1:
        more = len(errors) - 1
        message += f" (and {more} more problem{'s' if more > 1 else ''})"
    return ConfigError(message, file=shown, line=locator.line(line_loc))


def _describe(err: ErrorDetails, raw: Mapping[str, Any]) -> tuple[str, Loc]:
    """One readable sentence for a pydantic error, and the TOML location to look for its line."""
    loc: Loc = tuple(err["loc"])
    kind = err["type"]
    ctx = err.get("ctx") or {}

    prefix = ""
    rest = loc
    keys = _TABLE_KEYS.get(loc[:-1])
    if len(loc) >= 2 and loc[0] == "dataset" and isinstance(loc[1], int):
        prefix = _dataset_label(raw, loc[1]) + ": "
        rest = loc[2:]
        keys = _DATASET_KEYS if len(rest) == 1 else None
    field = _dotted(rest)

    if kind == _SAMPLING_ERROR:
        key = ctx.get("key")
        return prefix + str(ctx.get("detail", err["msg"])), (*loc, key) if isinstance(key, str) else loc
    if kind == "extra_forbidden":
        key = str(rest[-1]) if rest else "?"
        message = f'unknown key "{field}"'
        suggestion = _suggest(key, keys) if keys else None
        if suggestion:
            message += f' (did you mean "{suggestion}"?)'
        elif key in _TOP_LEVEL_KEYS and (prefix or len(rest) > 1):
            message += " (top-level keys must come before the first [table] in the file)"
        return prefix + message, loc
    if kind == "missing":
        if loc == ("server",):
            return "missing required table [server]", loc
        if loc == ("dataset",):
            return "no [[dataset]] table: at least one dataset is required", loc
        return f'{prefix}missing required key "{field}"', loc
    if loc == ("dataset",) and kind == "list_type":
        return "dataset must be an array of tables: write each one as [[dataset]]", loc
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return (f"{prefix}{field} must be a table" if field else f"{prefix}must be a table"), loc
    if kind == "too_short" and loc == ("dataset",):
        return "no [[dataset]] table: at least one dataset is required", loc
    if kind == "too_short" and loc == ("server", "urls"):
        return "server.urls: must list at least one URL", loc

    msg = err["msg"]
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
        return f"{prefix}{field}: {msg}" if field else prefix + msg, loc
    got = err.get("input")
    shown_input = f" (got {_quote(got)})" if isinstance(got, str | int | float | bool) else ""
    return f"{prefix}{field}: {_lower_first(msg)}{shown_input}" if field else prefix + msg, loc


def _dataset_label(raw: Mapping[str, Any], index: int) -> str:
    tables = raw.get("dataset")
    if isinstance(tables, list) and index < len(tables) and isinstance(tables[index], dict):
        name = tables[index].get("name")
        if isinstance(name, str) and name:
            return f"dataset {json.dumps(name, ensure_ascii=False)}"
    return f"dataset #{index + 1}"


def _dotted(loc: Loc) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


# ---------------------------------------------------------------------------------- line numbers (TOML)

_KEY_PART_RE: Final = re.compile(r"""\s*(?:([A-Za-z0-9_-]+)|"((?:[^"\\]|\\.)*)"|'([^']*)')\s*""")


def _parse_key(s: str, pos: int = 0) -> tuple[tuple[str, ...], int] | None:
    """A (dotted) TOML key at ``s[pos:]``: its parts and the position after it."""
    parts: list[str] = []
    while True:
        m = _KEY_PART_RE.match(s, pos)
        if not m:
            return None
        if m.group(1) is not None:
            parts.append(m.group(1))
        elif m.group(2) is not None:
            try:
                parts.append(json.loads(f'"{m.group(2)}"'))
            except ValueError:
                parts.append(m.group(2))
        else:
            parts.append(m.group(3))
        pos = m.end()
        if pos < len(s) and s[pos] == ".":
            pos += 1
            continue
        return tuple(parts), pos


def _scan(s: str, pos: int, open_string: str | None, depth: int) -> tuple[str | None, int]:
    """Carry TOML lexing state over ``s[pos:]``: the open multi-line string delimiter (or None) and the
    bracket depth of a value that spans lines. Ignores comments and the inside of strings."""
    i, n = pos, len(s)
    while i < n:
        if open_string is not None:
            close = s.find(open_string, i)
            if close < 0:
                return open_string, depth
            i = close + 3
            open_string = None
            continue
        c = s[i]
        if c == "#":
            break
        if s.startswith('"""', i) or s.startswith("'''", i):
            open_string = s[i : i + 3]
            i += 3
            continue
        if c in "\"'":
            i += 1
            while i < n and s[i] != c:
                i += 2 if c == '"' and s[i] == "\\" else 1
            i += 1
            continue
        if c in "[{":
            depth += 1
        elif c in "]}":
            depth = max(0, depth - 1)
        i += 1
    return open_string, depth


class _KeyLocator:
    """Best-effort map from a key's location (as pydantic reports it) to its first line in the TOML.

    tomllib keeps no positions, so this scans the text: table headers, ``[[array]]`` indices, dotted keys;
    it skips multi-line strings and arrays. A location it cannot find falls back to its nearest enclosing
    table or key, and to None.
    """

    def __init__(self, text: str) -> None:
        self._lines: dict[Loc, int] = {}
        table: Loc = ()
        array_index: dict[tuple[str, ...], int] = {}
        depth = 0
        open_string: str | None = None
        for line_no, line in enumerate(text.splitlines(), start=1):
            if open_string is not None or depth > 0:
                # Continuation of a multi-line string or array: no keys or headers here.
                open_string, depth = _scan(line, 0, open_string, depth)
                continue
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            if stripped.startswith("["):
                is_array = stripped.startswith("[[")
                parsed = _parse_key(stripped, 2 if is_array else 1)
                if parsed is None:
                    continue
                path = parsed[0]
                if is_array:
                    array_index[path] = array_index.get(path, -1) + 1
                    for nested in [k for k in array_index if len(k) > len(path) and k[: len(path)] == path]:
                        del array_index[nested]
                table = self._with_indices(path, array_index)
                self._record(table, line_no)
                continue
            parsed = _parse_key(line)
            if parsed is None or parsed[1] >= len(line) or line[parsed[1]] != "=":
                continue
            key, end = parsed
            self._record((*table, *key), line_no)
            open_string, depth = _scan(line, end + 1, None, 0)

    @staticmethod
    def _with_indices(path: tuple[str, ...], array_index: Mapping[tuple[str, ...], int]) -> Loc:
        loc: list[str | int] = []
        for i, part in enumerate(path):
            loc.append(part)
            index = array_index.get(path[: i + 1])
            if index is not None:
                loc.append(index)
        return tuple(loc)

    def _record(self, loc: Loc, line_no: int) -> None:
        for n in range(1, len(loc) + 1):
            self._lines.setdefault(loc[:n], line_no)

    def line(self, loc: Sequence[str | int]) -> int | None:
        """The line of ``loc``, else of its nearest recorded parent, else None."""
        loc = tuple(loc)
        for n in range(len(loc), 0, -1):
            found = self._lines.get(loc[:n])
            if found is not None:
                return found
        return None
