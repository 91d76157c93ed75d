"""Each ledger script's KEYS are declared once (``budget.scripts.SCRIPT_KEYS``): every script's header
says the same, no script binds its KEYS by hand, and the wrappers build their calls from the table."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from budget.keys import dataset_keys, server_keys
from budget.scripts import (
    DATASET_KEY_FIELDS,
    SCRIPT_KEYS,
    SCRIPT_NAMES,
    SERVER_KEY_FIELDS,
    dataset_script_keys,
    keys_prelude,
    script_source,
    server_script_keys,
)

LUA = resources.files("budget") / "lua"


def header_keys(name: str) -> str:
    text = (LUA / f"{name}.lua").read_text()
    match = re.search(r"^-- KEYS: (.*)$", text, re.M)
    assert match, f"{name}.lua has no KEYS header"
    return match.group(1)


def test_every_lua_file_is_a_registered_script_and_every_script_has_its_file() -> None:
    files = {p.name.removesuffix(".lua") for p in LUA.iterdir() if p.name.endswith(".lua")} - {"_lib"}
    assert files == set(SCRIPT_NAMES)


@pytest.mark.parametrize("name", [n for n, keys in SCRIPT_KEYS.items() if keys is not None])
def test_each_scripts_header_lists_the_keys_the_table_declares(name: str) -> None:
    listed = [
        re.sub(r"\(.*?\)", "", part).strip() for part in re.sub(r"\(.*?\)", "", header_keys(name)).split(",")
    ]
    assert tuple(listed) == SCRIPT_KEYS[name]


@pytest.mark.parametrize("name", [n for n, keys in SCRIPT_KEYS.items() if keys is not None])
def test_no_script_with_declared_keys_binds_or_indexes_keys_by_hand(name: str) -> None:
    body = (LUA / f"{name}.lua").read_text()
    assert "KEYS[" not in body, f"{name}.lua indexes KEYS itself: its locals come from SCRIPT_KEYS"


@pytest.mark.parametrize("name", [n for n, keys in SCRIPT_KEYS.items() if keys is None])
def test_a_script_with_variable_keys_documents_their_layout(name: str) -> None:
    assert "each" in header_keys(name) or "for" in header_keys(name)
    assert keys_prelude(name) == ""


def test_the_loader_binds_the_declared_keys_before_the_body() -> None:
    source = script_source("progress")
    binding = "local ledger, leases, owners = KEYS[1], KEYS[2], KEYS[3]\n"
    assert binding in source
    assert source.index(binding) < source.index("-- progress:")


def test_every_key_name_stands_for_a_dataset_server_or_named_key() -> None:
    named = {"queue", "workers"}  # the broker's list and the workers' hash: passed by the caller
    for keys in SCRIPT_KEYS.values():
        for key in keys or ():
            assert key in DATASET_KEY_FIELDS or key in SERVER_KEY_FIELDS or key in named, key


def test_calls_are_built_in_the_declared_order() -> None:
    k = dataset_keys("ds")
    assert dataset_script_keys("purge_queue", k, queue="celery") == ["celery", k.queued_zset, k.pending_hash]
    assert dataset_script_keys("renew", k) == [
        k.ledger_hash,
        k.lease_zset,
        k.lease_owner_hash,
        k.live_hash,
        k.rate_tokens_hash,
    ]
    assert dataset_script_keys("admit", k)[6:8] == [k.live_hash, k.reserved_hash]
    s = server_keys("http://a:1")
    assert server_script_keys("server_report", s) == [s.health_hash, s.probe_str]
