"""``load_config``: read the TOML, validate it, resolve paths and sources, merge the sampling tables."""

from __future__ import annotations

import copy
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import (
    ValidationError,
)

from budget.urls import REDIS_URL_ENV
from producer.source import SourceError, check_source
from tokenfleet.config.errors import ConfigError
from tokenfleet.config.models import (
    _INHERITED_KEYS,
    DatasetConfig,
    FleetConfig,
    _check_unique_names,
    _ConfigFile,
    check_redis_url,
)
from tokenfleet.config.toml_lines import _KeyLocator
from tokenfleet.config.wording import _toml_syntax_error, _translate
from workers.sglang.protocol import (
    SGLANG_DEFAULT_MAX_NEW_TOKENS,
)

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
            redis_url = check_redis_url(override)
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
