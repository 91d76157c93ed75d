"""The chat keys of the config: tokenizer, format, id_field, regenerate, system_prompt, top level as
defaults and per dataset."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tokenfleet.config import ConfigError, load_config

HEAD = """\
tokenizer = "tok"
regenerate = "all"
system_prompt = "be terse"

[server]
urls = ["http://127.0.0.1:30000"]
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    (tmp_path / "tok").mkdir()
    return tmp_path


def write(folder: Path, text: str) -> Path:
    path = folder / "config.toml"
    path.write_text(textwrap.dedent(text))
    return path


def error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    return str(info.value)


def test_top_level_keys_are_defaults_a_dataset_may_override(project: Path) -> None:
    path = write(
        project,
        HEAD
        + """
[[dataset]]
name = "a"
path = "data/a.jsonl"

[[dataset]]
name = "b"
path = "data/a.jsonl"
format = "sharegpt"
id_field = "uuid"
regenerate = "last"
system_prompt = "be verbose"
tokenizer = "Qwen/Qwen3-8B"
""",
    )
    a, b = load_config(path, env={}).datasets
    assert (a.tokenizer, a.format, a.id_field, a.regenerate, a.system_prompt) == (
        str(project / "tok"),
        "auto",
        "id",
        "all",
        "be terse",
    )
    # A tokenizer that is not a folder here and does not look like a path is a model id.
    assert (b.tokenizer, b.format, b.id_field, b.regenerate, b.system_prompt) == (
        "Qwen/Qwen3-8B",
        "sharegpt",
        "uuid",
        "last",
        "be verbose",
    )


def test_a_dataset_without_chat_keys_reads_plain_records_as_before(project: Path) -> None:
    path = write(
        project,
        '[server]\nurls = ["http://127.0.0.1:30000"]\n[[dataset]]\nname = "a"\npath = "data/a.jsonl"\n',
    )
    (ds,) = load_config(path, env={}).datasets
    assert (ds.tokenizer, ds.format, ds.id_field, ds.regenerate, ds.system_prompt) == (
        None,
        "auto",
        "id",
        "last",
        None,
    )


def test_a_tokenizer_path_that_does_not_exist_names_its_line(project: Path) -> None:
    path = write(
        project, HEAD.replace('"tok"', '"./nope"') + '[[dataset]]\nname = "a"\npath = "data/a.jsonl"\n'
    )
    assert error(path) == (
        f'{path}:1: dataset "a": tokenizer "./nope": no such folder ({project.resolve() / "nope"})'
    )


def test_a_system_prompt_without_a_tokenizer_is_an_error_naming_its_line(project: Path) -> None:
    dataset = '[[dataset]]\nname = "a"\npath = "data/a.jsonl"\nsystem_prompt = "hi"\n'
    path = write(project, '[server]\nurls = ["http://x:1"]\n' + dataset)
    assert error(path) == (
        f'{path}:6: dataset "a": system_prompt needs a tokenizer '
        "(the prompt is written with the model's chat template)"
    )


def test_an_unknown_format_lists_the_known_ones(project: Path) -> None:
    path = write(project, HEAD + '[[dataset]]\nname = "a"\npath = "data/a.jsonl"\nformat = "alpaca"\n')
    message = error(path)
    assert message.startswith(f'{path}:10: dataset "a": format: ')
    for name in ("auto", "messages", "sharegpt", "specforge", "text", "input_ids"):
        assert f"'{name}'" in message


class StubServer:
    """A server whose /server_info has no context_length (sglang's default) but whose /v1/models does."""

    def server_info(self, url: str) -> dict[str, object]:
        return {"context_length": None}

    def get_json(self, url: str, path: str) -> dict[str, object]:
        if path == "/model_info":
            return {"model_path": "/nowhere"}
        assert path == "/v1/models"
        return {"data": [{"id": "m", "max_model_len": 4096}]}

    def generate(self, url: str, **kwargs: object) -> None:
        return None


def test_the_context_length_comes_from_v1_models_when_server_info_has_none(project: Path) -> None:
    from tokenfleet.submit import check_servers

    path = write(
        project,
        '[server]\nurls = ["http://127.0.0.1:30000"]\n[[dataset]]\nname = "a"\npath = "data/a.jsonl"\n',
    )
    facts = check_servers(load_config(path, env={}), StubServer())  # type: ignore[arg-type]
    assert facts["http://127.0.0.1:30000"].context_length == 4096
