from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from tokenfleet.config import (
    DEFAULT_REDIS_URL,
    REDIS_URL_ENV,
    ConfigError,
    DatasetConfig,
    FleetConfig,
    ServerConfig,
    load_config,
    redact_url,
)
from workers.sglang.protocol import SGLANG_DEFAULT_MAX_NEW_TOKENS

BASE = """\
[server]
urls = ["http://127.0.0.1:30000"]

[[dataset]]
name = "a"
path = "data/a.jsonl"
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A folder with data/a.jsonl and data/b.jsonl."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "data" / "b.jsonl").write_text('{"text": "y"}\n')
    return tmp_path


def write_config(folder: Path, text: str, name: str = "config.toml") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def load_error(path: Path, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, env={} if env is None else env)
    message = str(info.value)
    assert "\n" not in message
    return message


def line_of(path: Path, needle: str) -> int:
    lines = path.read_text().splitlines()
    matches = [i for i, line in enumerate(lines, start=1) if needle in line]
    assert len(matches) == 1, matches
    return matches[0]


# ----------------------------------------------------------------------------------------- happy paths


def test_a_full_config_loads_with_absolute_paths_and_merged_sampling(project: Path) -> None:
    path = write_config(
        project,
        """\
        redis_url = "redis://127.0.0.1:6380/2"
        output_dir = "results"

        [server]
        urls = ["http://10.0.0.1:30000/", "https://gpu2.example:8443/sglang"]
        timeout_s = 90

        [sampling]
        max_new_tokens = 4096
        temperature = 0.7
        stop = ["</s>"]

        [[dataset]]
        name = "B2_opencodeinstruct"
        path = "data/a.jsonl"
        token_budget = 10_000_000
        max_samples = 7000
        on_budget = "discard"

        [dataset.sampling]
        temperature = 0.2

        [[dataset]]
        name = "second.v2-x"
        path = "data/b.jsonl"
        """,
    )
    cfg = load_config(path, env={})
    assert cfg.redis_url == "redis://127.0.0.1:6380/2"
    assert cfg.output_dir == project.resolve() / "results"
    assert cfg.source_path == path
    assert cfg.server == ServerConfig(
        urls=["http://10.0.0.1:30000", "https://gpu2.example:8443/sglang"], timeout_s=90
    )
    assert cfg.sampling == {"max_new_tokens": 4096, "temperature": 0.7, "stop": ["</s>"]}
    first, second = cfg.datasets
    assert first == DatasetConfig(
        name="B2_opencodeinstruct",
        path=project.resolve() / "data" / "a.jsonl",
        token_budget=10_000_000,
        max_samples=7000,
        on_budget="discard",
        sampling={"max_new_tokens": 4096, "temperature": 0.2, "stop": ["</s>"]},
    )
    assert second.name == "second.v2-x"
    assert second.path.is_absolute()
    assert second.token_budget is None
    assert second.max_samples is None
    assert second.on_budget == "truncate"
    assert second.sampling == {
        "max_new_tokens": 4096,
        "temperature": 0.7,
        "stop": ["</s>"],
    }
    assert cfg.get_dataset("second.v2-x") is second


def test_defaults_apply_when_keys_are_absent(project: Path) -> None:
    cfg = load_config(write_config(project, BASE), env={})
    assert cfg.redis_url == DEFAULT_REDIS_URL == "redis://127.0.0.1:6379/0"
    assert cfg.output_dir == project.resolve() / "out"
    assert cfg.server.timeout_s == 1800
    assert cfg.sampling == {}
    assert cfg.datasets[0].on_budget == "truncate"


def test_relative_paths_resolve_against_the_config_folder_not_the_cwd(
    project: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_config(project, BASE)
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    cfg = load_config(path, env={})
    assert cfg.datasets[0].path == project.resolve() / "data" / "a.jsonl"
    assert cfg.output_dir == project.resolve() / "out"


def test_a_relative_config_path_is_named_as_given_and_resolved(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_config(project, BASE)
    monkeypatch.chdir(project)
    cfg = load_config("config.toml", env={})
    assert cfg.source_path == project / "config.toml"
    assert cfg.source_path.is_absolute()


def test_max_new_tokens_defaults_to_sglangs_128_when_absent(project: Path) -> None:
    path = write_config(project, BASE + "[dataset.sampling]\ntemperature = 0.5\n")
    cfg = load_config(path, env={})
    # The effective sampling: what is sent, with the default tokenfleet applies. No stream_interval: a
    # worker picks one per request when the dataset sets none (workers/stream_pacing.py).
    assert cfg.datasets[0].sampling == {"temperature": 0.5, "max_new_tokens": 128}
    assert SGLANG_DEFAULT_MAX_NEW_TOKENS == 128
    assert cfg.sampling == {}  # the top-level table is left as written


def test_dataset_overrides_do_not_leak_into_other_datasets(project: Path) -> None:
    path = write_config(
        project,
        """\
        [server]
        urls = ["http://h:1"]
        [sampling]
        stop = ["a"]
        [[dataset]]
        name = "one"
        path = "data/a.jsonl"
        [dataset.sampling]
        stop = ["b"]
        [[dataset]]
        name = "two"
        path = "data/b.jsonl"
        """,
    )
    cfg = load_config(path, env={})
    assert cfg.get_dataset("one").sampling["stop"] == ["b"]
    assert cfg.get_dataset("two").sampling["stop"] == ["a"]
    cfg.get_dataset("two").sampling["stop"].append("mutated")
    assert cfg.sampling["stop"] == ["a"]


def test_a_utf8_bom_at_the_start_of_the_file_is_accepted(project: Path) -> None:
    path = project / "config.toml"
    path.write_bytes(b"\xef\xbb\xbf" + BASE.encode())
    assert load_config(path, env={}).datasets[0].name == "a"


# ------------------------------------------------------------------------------------------- redis_url


def test_env_redis_url_overrides_the_file(project: Path) -> None:
    path = write_config(project, 'redis_url = "redis://file-host:6379/0"\n' + BASE)
    cfg = load_config(path, env={REDIS_URL_ENV: "redis://env-host:6379/3"})
    assert REDIS_URL_ENV == "TOKENFLEET_REDIS_URL"
    assert cfg.redis_url == "redis://env-host:6379/3"


def test_env_defaults_to_os_environ(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REDIS_URL_ENV, "rediss://env-host:6380/1")
    assert load_config(write_config(project, BASE)).redis_url == "rediss://env-host:6380/1"


def test_an_empty_env_redis_url_is_ignored(project: Path) -> None:
    path = write_config(project, 'redis_url = "redis://file-host:6379/0"\n' + BASE)
    assert load_config(path, env={REDIS_URL_ENV: "  "}).redis_url == "redis://file-host:6379/0"


def test_a_bad_env_redis_url_is_an_error_naming_the_variable_without_the_password(project: Path) -> None:
    message = load_error(write_config(project, BASE), env={REDIS_URL_ENV: "http://u:hunter2@h/0"})
    assert message == 'TOKENFLEET_REDIS_URL: unsupported scheme "http" (use redis://, rediss:// or unix://)'


def test_a_redis_url_with_an_unsupported_scheme_names_its_line(project: Path) -> None:
    path = write_config(project, 'redis_url = "mysql://h/0"\n' + BASE)
    assert load_error(path) == (
        f'{path}:1: redis_url: unsupported scheme "mysql" (use redis://, rediss:// or unix://)'
    )


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://user:secret@host:6379/0", "redis://user:***@host:6379/0"),
        ("redis://:secret@host:6379/0", "redis://:***@host:6379/0"),
        ("rediss://default:p@ss/w0rd@host:6380", "rediss://default:***@host:6380"),
        ("redis://host:6379/0", "redis://host:6379/0"),
        ("redis://user@host:6379/0", "redis://user@host:6379/0"),
        ("redis://host/0?password=secret&db=1", "redis://host/0?password=***&db=1"),
        ("unix://:secret@/run/redis.sock?db=0", "unix://:***@/run/redis.sock?db=0"),
        ("unix:///run/redis.sock", "unix:///run/redis.sock"),
        ("not a url", "not a url"),
        ("", ""),
    ],
)
def test_redact_url_replaces_any_password(url: str, expected: str) -> None:
    assert redact_url(url) == expected
    assert redact_url(expected) == expected


def test_the_repr_of_a_config_never_shows_passwords(project: Path) -> None:
    path = write_config(
        project,
        BASE.replace("http://127.0.0.1:30000", "http://admin:s3rv3rpw@127.0.0.1:30000"),
    )
    cfg = load_config(path, env={REDIS_URL_ENV: "redis://user:r3dispw@host:6379/0"})
    assert cfg.redis_url == "redis://user:r3dispw@host:6379/0"
    for text in (repr(cfg), str(cfg), repr(cfg.server)):
        assert "r3dispw" not in text
        assert "s3rv3rpw" not in text
    assert "redis://user:***@host:6379/0" in repr(cfg)


def test_an_error_about_a_server_url_never_shows_its_password(project: Path) -> None:
    path = write_config(project, BASE.replace("http://127.0.0.1:30000", "ftp://u:s3cret@h:21"))
    message = load_error(path)
    assert "s3cret" not in message
    assert message == (
        f'{path}:2: server.urls: "ftp://u:***@h:21" is not an http(s) URL like http://127.0.0.1:30000'
    )


# -------------------------------------------------------------------------------------------- sampling


def test_unknown_sampling_key_names_the_line_and_suggests(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_config(
        project,
        """\
        [server]
        urls = ["http://127.0.0.1:30000"]

        [sampling]
        max_new_tokens = 4096

        [[dataset]]
        name = "ok"
        path = "data/a.jsonl"

        [[dataset]]
        name = "x"
        path = "data/b.jsonl"
        [dataset.sampling]
        temperature = 0.2
        max_tokens = 512
        """,
    )
    monkeypatch.chdir(project)
    assert load_error(Path("config.toml")) == (
        'config.toml:16: dataset "x": unknown sampling_params key "max_tokens" '
        '(SGLang 0.5 rejects it on every request; did you mean "max_new_tokens"?)'
    )


def test_unknown_top_level_sampling_key_names_its_line(project: Path) -> None:
    path = write_config(project, "[sampling]\ntemprature = 0.1\n\n" + BASE)
    assert load_error(path) == (
        f'{path}:2: unknown sampling_params key "temprature" '
        '(SGLang 0.5 rejects it on every request; did you mean "temperature"?)'
    )


def test_openai_style_seed_suggests_sampling_seed(project: Path) -> None:
    path = write_config(project, BASE + "sampling = { seed = 1 }\n")
    message = load_error(path)
    assert message.startswith(f'{path}:7: dataset "a": unknown sampling_params key "seed" ')
    assert message.endswith('did you mean "sampling_seed"?)')


def test_an_unknown_sampling_key_without_a_close_match_gets_no_suggestion(project: Path) -> None:
    path = write_config(project, BASE + "[dataset.sampling]\nzzzzqq = 1\nqqzzzz = 2\n")
    assert load_error(path) == (
        f'{path}:8: dataset "a": unknown sampling_params key "zzzzqq" '
        '(SGLang 0.5 rejects it on every request); also unknown: "qqzzzz"'
    )


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "true", '"4096"'])
def test_max_new_tokens_must_be_an_integer_of_at_least_one(project: Path, value: str) -> None:
    path = write_config(project, f"[sampling]\nmax_new_tokens = {value}\n\n" + BASE)
    message = load_error(path)
    assert message.startswith(f'{path}:2: sampling_params "max_new_tokens" must be an integer >= 1, got ')


def test_a_sampling_value_that_cannot_be_json_is_rejected(project: Path) -> None:
    path = write_config(project, BASE + "[dataset.sampling]\ntemperature = 0.5\nstop = [1979-05-27]\n")
    assert load_error(path) == (
        f'{path}:9: dataset "a": sampling_params "stop": a date value cannot be sent as JSON'
    )


def test_a_nan_sampling_value_is_rejected(project: Path) -> None:
    path = write_config(project, "[sampling]\ntemperature = nan\n" + BASE)
    assert load_error(path) == (
        f'{path}:2: sampling_params "temperature": nan is not a finite number (JSON has no NaN/inf)'
    )


# --------------------------------------------------------------------------------------------- datasets


@pytest.mark.parametrize("name", ["a/b", "../escape", "a b", "x\\y", "ünïcode", ""])
def test_dataset_name_with_slash_or_other_characters_is_rejected(project: Path, name: str) -> None:
    path = write_config(project, BASE.replace('name = "a"', f"name = '{name}'"))
    message = load_error(path)
    assert message.startswith(f"{path}:5: dataset ")
    assert ": name: must " in message


@pytest.mark.parametrize("name", [".", ".."])
def test_dataset_name_dot_or_dot_dot_is_rejected(project: Path, name: str) -> None:
    path = write_config(project, BASE.replace('name = "a"', f'name = "{name}"'))
    assert load_error(path) == (
        f'{path}:5: dataset "{name}": name: must not be "{name}" (it names a folder under output_dir)'
    )


def test_dataset_name_longer_than_128_chars_is_rejected(project: Path) -> None:
    path = write_config(project, BASE.replace('name = "a"', f'name = "{"n" * 129}"'))
    assert load_error(path).endswith("name: must be at most 128 characters (it has 129)")
    ok = write_config(project, BASE.replace('name = "a"', f'name = "{"n" * 128}"'), name="ok.toml")
    assert load_config(ok, env={}).datasets[0].name == "n" * 128


def test_duplicate_dataset_names_are_rejected_with_both_lines(project: Path) -> None:
    path = write_config(project, BASE + '\n[[dataset]]\nname = "A"\npath = "data/b.jsonl"\n')
    assert load_error(path) == (
        f'{path}:9: dataset "A": name already used by dataset #1 at line 5 '
        "(names must be unique, ignoring case: each names a folder under output_dir)"
    )


def test_a_missing_dataset_file_is_an_error_naming_the_line(project: Path) -> None:
    path = write_config(project, BASE.replace("data/a.jsonl", "data/nope.jsonl"))
    assert load_error(path) == (
        f'{path}:6: dataset "a": path "data/nope.jsonl": no such file '
        f"(resolved to {project.resolve() / 'data' / 'nope.jsonl'})"
    )


def test_a_dataset_path_that_is_a_directory_is_rejected(project: Path) -> None:
    path = write_config(project, BASE.replace('"data/a.jsonl"', f'"{project / "data"}"'))
    assert load_error(path) == f'{path}:6: dataset "a": path "{project / "data"}": is a directory, not a file'


def test_a_typo_in_a_dataset_key_suggests_the_right_one(project: Path) -> None:
    path = write_config(project, BASE + "tokn_budget = 5\n")
    assert (
        load_error(path) == f'{path}:7: dataset "a": unknown key "tokn_budget" (did you mean "token_budget"?)'
    )


def test_a_typo_in_a_server_key_suggests_the_right_one(project: Path) -> None:
    path = write_config(project, BASE.replace("[server]\n", "[server]\ntimeout = 5\n"))
    assert load_error(path) == f'{path}:2: unknown key "server.timeout" (did you mean "timeout_s"?)'


def test_a_top_level_key_written_after_a_table_gets_a_hint(project: Path) -> None:
    path = write_config(project, BASE.replace("[[dataset]]", 'redis_url = "redis://h:1/0"\n\n[[dataset]]'))
    line = line_of(path, "redis_url =")
    assert line == 4
    assert load_error(path) == (
        f'{path}:{line}: unknown key "server.redis_url" '
        "(top-level keys must come before the first [table] in the file)"
    )


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("token_budget = 0", "token_budget: input should be greater than or equal to 1 (got 0)"),
        ('token_budget = "100"', 'token_budget: input should be a valid integer (got "100")'),
        ("token_budget = 1e7", "token_budget: input should be a valid integer (got 10000000.0)"),
        ("max_samples = true", "max_samples: input should be a valid integer (got true)"),
        (
            'on_budget = "trunc"',
            "on_budget: input should be 'truncate', 'discard' or 'drain' (got \"trunc\")",
        ),
    ],
)
def test_bad_dataset_values_are_one_readable_line(project: Path, line: str, expected: str) -> None:
    path = write_config(project, BASE + line + "\n")
    assert load_error(path) == f'{path}:7: dataset "a": {expected}'


def test_a_missing_dataset_key_names_the_dataset_header(project: Path) -> None:
    path = write_config(project, BASE.replace('path = "data/a.jsonl"\n', ""))
    assert load_error(path) == f'{path}:4: dataset "a": missing required key "path"'


def test_no_dataset_is_an_error(project: Path) -> None:
    path = write_config(project, '[server]\nurls = ["http://h:1"]\n')
    assert load_error(path) == f"{path}: no [[dataset]] table: at least one dataset is required"


def test_a_dataset_written_as_a_single_table_explains_the_double_brackets(project: Path) -> None:
    path = write_config(project, BASE.replace("[[dataset]]", "[dataset]"))
    assert load_error(path) == f"{path}:4: dataset must be an array of tables: write each one as [[dataset]]"


def test_several_problems_are_counted_on_the_one_line(project: Path) -> None:
    path = write_config(project, BASE + "token_budget = 0\nmax_samples = 0\n")
    assert load_error(path).endswith("(got 0) (and 1 more problem)")


def test_output_dir_that_is_a_file_is_rejected(project: Path) -> None:
    (project / "out").write_text("")
    path = write_config(project, 'output_dir = "out"\n' + BASE)
    assert (
        load_error(path)
        == f'{path}:1: output_dir "out" exists and is not a directory ({project.resolve() / "out"})'
    )


# ----------------------------------------------------------------------------------------------- server


def test_missing_server_table_is_an_error(project: Path) -> None:
    path = write_config(project, BASE.replace('[server]\nurls = ["http://127.0.0.1:30000"]\n', ""))
    assert load_error(path) == f"{path}: missing required table [server]"


def test_server_urls_must_not_be_empty(project: Path) -> None:
    path = write_config(project, BASE.replace('["http://127.0.0.1:30000"]', "[]"))
    assert load_error(path) == f"{path}:2: server.urls: must list at least one URL"


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("127.0.0.1:30000", "is not an http(s) URL"),
        ("http://", "is not an http(s) URL"),
        ("http://h:1?x=1", "must not have a query or fragment"),
        ("http://h:notaport", "is not a valid URL"),
        ("http://h :1", "must not be empty or contain whitespace"),
    ],
)
def test_server_urls_must_be_http_urls(project: Path, url: str, problem: str) -> None:
    path = write_config(project, BASE.replace("http://127.0.0.1:30000", url))
    message = load_error(path)
    assert message.startswith(f"{path}:2: server.urls: ")
    assert problem in message


def test_a_server_url_listed_twice_is_rejected(project: Path) -> None:
    path = write_config(project, BASE.replace('["http://127.0.0.1:30000"]', '["http://h:1/", "http://h:1"]'))
    assert load_error(path) == f'{path}:2: server.urls: "http://h:1" is listed twice'


@pytest.mark.parametrize("value", ["0", "-1", "inf", '"10"'])
def test_timeout_must_be_a_positive_number(project: Path, value: str) -> None:
    path = write_config(project, BASE.replace("[server]\n", f"[server]\ntimeout_s = {value}\n"))
    assert load_error(path).startswith(f"{path}:2: server.timeout_s: input should be")


# ------------------------------------------------------------------------------------ file-level errors


def test_missing_config_file_says_no_such_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert load_error(Path("config.toml")) == "config.toml: no such file"


def test_a_directory_as_config_is_an_error(tmp_path: Path) -> None:
    assert load_error(tmp_path) == f"{tmp_path}: is a directory, not a file"


def test_toml_syntax_error_reports_the_line(project: Path) -> None:
    path = write_config(project, BASE + "max_samples = \n")
    assert load_error(path) == f"{path}:7: invalid TOML: invalid value (column 15)"


def test_a_repeated_table_is_a_toml_error_with_its_line(project: Path) -> None:
    path = write_config(project, BASE.replace("[[dataset]]", "[server]\n[[dataset]]"))
    message = load_error(path)
    assert message.startswith(f"{path}:4: invalid TOML: ")


def test_invalid_utf8_in_the_config_names_the_line(project: Path) -> None:
    path = project / "config.toml"
    path.write_bytes(BASE.encode() + b'max_samples = "\xff"\n')
    assert load_error(path) == f"{path}:7: invalid TOML: not valid UTF-8"


def test_pydantic_errors_are_translated_never_dumped(project: Path) -> None:
    path = write_config(
        project, BASE.replace("[server]\n", '[server]\ntimeout_s = "x"\n') + "max_samples = 0\n"
    )
    message = load_error(path)
    assert "validation error" not in message
    assert message.startswith(f'{path}:2: server.timeout_s: input should be a valid number (got "x")')
    assert "errors.pydantic.dev" not in message
    assert "For further information" not in message
    assert "type=" not in message
    assert "ServerConfig" not in message


# --------------------------------------------------------------------------------------- models directly


def test_models_forbid_unknown_keys_when_built_directly() -> None:
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        ServerConfig(urls=["http://h:1"], timeout=3)  # type: ignore[call-arg]


def test_a_fleet_config_built_directly_rejects_duplicate_names(tmp_path: Path) -> None:
    ds = DatasetConfig(name="a", path=tmp_path / "a.jsonl")
    with pytest.raises(ValidationError, match="used twice"):
        FleetConfig(
            output_dir=tmp_path,
            server=ServerConfig(urls=["http://h:1"]),
            datasets=[ds, ds],
            source_path=tmp_path / "config.toml",
        )


def test_a_dataset_config_built_directly_validates_name_and_sampling(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="must contain only letters"):
        DatasetConfig(name="a/b", path=tmp_path)
    with pytest.raises(ValidationError, match='unknown sampling_params key "max_tokens"'):
        DatasetConfig(name="a", path=tmp_path, sampling={"max_tokens": 5})


def test_configs_are_frozen(project: Path) -> None:
    cfg = load_config(write_config(project, BASE), env={})
    with pytest.raises(ValidationError):
        cfg.redis_url = "redis://other/0"  # type: ignore[misc]


def test_config_error_formats_file_and_line() -> None:
    assert str(ConfigError("bad", file="c.toml", line=3)) == "c.toml:3: bad"
    assert str(ConfigError("bad", file="c.toml")) == "c.toml: bad"
    assert str(ConfigError("bad\n  thing")) == "bad thing"


def test_line_numbers_survive_multiline_strings_and_arrays(project: Path) -> None:
    path = write_config(
        project,
        '''\
        [server]
        urls = [
          "http://h:1",  # [[dataset]]
        ]
        [sampling]
        stop = ["""
        [[dataset]]
        max_samples = 0
        """, 'x = 1']

        [[dataset]]
        name = "a"
        path = "data/a.jsonl"

        [[dataset]]
        name = "b"
        path = "data/b.jsonl"
        max_samples = 0
        ''',
    )
    assert load_error(path) == (
        f'{path}:18: dataset "b": max_samples: input should be greater than or equal to 1 (got 0)'
    )


def test_an_inline_array_of_datasets_points_at_its_key(project: Path) -> None:
    path = write_config(
        project,
        """\
        dataset = [
          {name = "a", path = "data/a.jsonl"},
          {name = "b/c", path = "data/b.jsonl"},
        ]
        [server]
        urls = ["http://h:1"]
        """,
    )
    message = load_error(path)
    assert message.startswith(f'{path}:1: dataset "b/c": name: must contain only letters')


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("n = 2", 'sampling_params "n" = 2: tokenfleet writes one output per request'),
        ("beam_width = 4", 'sampling_params "beam_width": beam search turns one request into a batch'),
    ],
)
def test_n_above_one_and_beam_search_are_rejected_with_what_to_do_instead(
    project: Path, line: str, needle: str
) -> None:
    path = write_config(project, f"[sampling]\nmax_new_tokens = 16\n{line}\n\n" + BASE)
    message = load_error(path)
    assert message.startswith(f"{path}:3: ") and needle in message


def test_n_of_one_is_accepted(project: Path) -> None:
    path = write_config(project, "[sampling]\nn = 1\n\n" + BASE)
    assert load_config(path, env={}).datasets[0].sampling["n"] == 1


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('temperature = "0.7"', "sampling_params `temperature` must be a number"),
        ("top_k = 2.5", "sampling_params `top_k` must be an integer"),
        ("ignore_eos = 1", "sampling_params `ignore_eos` must be true or false"),
    ],
)
def test_a_sampling_value_of_the_wrong_type_is_refused_at_load_as_the_server_would(
    project: Path, line: str, needle: str
) -> None:
    path = write_config(project, f"[sampling]\nmax_new_tokens = 16\n{line}\n\n" + BASE)
    message = load_error(path)
    assert message.startswith(f"{path}:3: ") and needle in message


def test_an_integer_where_a_number_is_expected_is_accepted(project: Path) -> None:
    path = write_config(project, "[sampling]\ntemperature = 1\n\n" + BASE)
    assert load_config(path, env={}).datasets[0].sampling["temperature"] == 1
