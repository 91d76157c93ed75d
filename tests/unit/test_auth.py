"""API keys: where each process finds them, what is sent, and that a key never shows."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.files import write_config
from tokenfleet.config import ConfigError, load_config
from workers.sglang.auth import KeyRef, MissingKey, ServerAuth, read_key, server_auth


def test_a_key_is_read_from_the_named_environment_variable() -> None:
    assert read_key(KeyRef(env="K"), {"K": " secret \n"}) == "secret"


def test_a_missing_or_empty_variable_is_a_missing_key_naming_it() -> None:
    with pytest.raises(MissingKey, match="environment variable K is not set"):
        read_key(KeyRef(env="K"), {"K": " "})


def test_a_key_is_read_from_a_secret_file(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text("from-file\n")
    assert read_key(KeyRef(file=str(path))) == "from-file"
    with pytest.raises(MissingKey, match="cannot read the file"):
        read_key(KeyRef(file=str(tmp_path / "absent")))


def test_the_api_key_goes_as_a_bearer_header_and_aborts_prefer_the_admin_key() -> None:
    auth = server_auth({"api_key": {"env": "A"}, "admin_api_key": {"env": "B"}}, {"A": "a1", "B": "b2"})
    assert auth.headers() == {"Authorization": "Bearer a1"}
    assert auth.admin_headers() == {"Authorization": "Bearer b2"}
    assert ServerAuth(api_key="a1").admin_headers() == {"Authorization": "Bearer a1"}
    assert ServerAuth().headers() == {}


def test_a_servers_auth_never_shows_its_keys() -> None:
    shown = repr(ServerAuth(api_key="s3cr3t", admin_api_key="adm1n"))
    assert "s3cr3t" not in shown and "adm1n" not in shown


def test_the_config_names_where_keys_are_and_per_server_keys_override(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        redis_url="redis://127.0.0.1:6379/0",
        servers=["http://a:1", "http://b:2"],
        datasets=[{"name": "ds", "rows": [{"input_ids": [5, 6, 7]}]}],
    )
    text = config.read_text().replace(
        "timeout_s = 60\n",
        'timeout_s = 60\napi_key_env = "SGLANG_API_KEY"\n'
        '[server.keys."http://b:2"]\napi_key_file = "/run/secrets/b"\nadmin_api_key_env = "B_ADMIN"\n',
    )
    config.write_text(text)
    refs = load_config(config, env={}).server.auth_refs()
    assert refs == {
        "http://a:1": {"api_key": {"env": "SGLANG_API_KEY"}},
        "http://b:2": {"api_key": {"file": "/run/secrets/b"}, "admin_api_key": {"env": "B_ADMIN"}},
    }


def test_a_key_from_both_a_variable_and_a_file_is_a_config_error(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        redis_url="redis://127.0.0.1:6379/0",
        servers=["http://a:1"],
        datasets=[{"name": "ds", "rows": [{"input_ids": [5, 6, 7]}]}],
    )
    both = 'timeout_s = 60\napi_key_env = "K"\napi_key_file = "/k"\n'
    config.write_text(config.read_text().replace("timeout_s = 60\n", both))
    with pytest.raises(ConfigError, match="api_key_env and api_key_file"):
        load_config(config, env={})
