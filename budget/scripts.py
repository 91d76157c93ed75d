"""The ledger's Lua scripts: each one's KEYS declared once, and the text sent to Redis.

``SCRIPT_KEYS`` is the one place a script's KEYS order is written. The loader binds them to Lua locals of
the same names before the script's body (``local ledger, done = KEYS[1], KEYS[2]``), the Python wrappers
build their calls from it (``dataset_script_keys``), and a unit test checks every script's ``-- KEYS:``
header against it. A script whose KEYS depend on its arguments (one group per server) says ``None`` and
documents its layout in its header.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Final

import redis
from redis.commands.core import Script

from budget.keys import DatasetKeys, ServerKeys

#: Each script's KEYS, in order, by the names its body uses; ``None``: variable, see the script's header.
SCRIPT_KEYS: Final[Mapping[str, tuple[str, ...] | None]] = {
    "register": ("ledger", "spec"),
    "set_limits": ("ledger",),
    "set_state": ("ledger",),
    "enqueue": ("ledger", "done", "failed", "queued", "leases", "pending"),
    "unqueue": ("queued", "pending"),
    "admit": (
        "ledger",
        "spec",
        "done",
        "queued",
        "leases",
        "owners",
        "live",
        "reserved",
        "clock",
        "pending",
        "failed",
    ),
    "grant": (
        "ledger",
        "leases",
        "owners",
        "reserved",
        "clock",
        "done",
        "live",
        "pending",
        "failed",
    ),
    "progress": ("ledger", "leases", "owners"),
    "stop_check": ("ledger",),
    "fed": ("ledger",),
    "output_problem": ("ledger",),
    "renew": ("ledger", "leases", "owners", "live", "rate_tokens"),
    "commit": (
        "ledger",
        "done",
        "leases",
        "owners",
        "live",
        "reserved",
        "clock",
        "pending",
        "rate_tokens",
        "rate_samples",
        "lengths",
    ),
    "fail": ("ledger", "done", "failed", "leases", "owners", "live", "reserved", "clock", "pending"),
    "release": ("ledger", "done", "leases", "owners", "live", "reserved", "clock", "pending", "failed"),
    "reclaim": ("ledger", "leases", "owners", "live", "reserved", "clock", "pending", "done", "failed"),
    "set_source": ("ledger",),
    "snapshot": (
        "ledger",
        "done",
        "failed",
        "queued",
        "leases",
        "pending",
        "rate_tokens",
        "rate_samples",
        "lengths",
    ),
    "purge_queue": ("queue", "queued", "pending"),
    "give_up": (
        "ledger",
        "done",
        "leases",
        "owners",
        "live",
        "reserved",
        "clock",
        "pending",
        "failed",
        "strikes",
    ),
    "audit_queued": ("queue", "queued", "leases", "done", "pending"),
    "clear_pending": ("ledger", "pending", "done", "failed", "queued", "leases"),
    "hold": ("ledger", "done", "leases", "owners", "live", "reserved", "clock", "held"),
    "unhold": ("ledger", "held"),
    "heartbeat": ("workers",),
    "server_acquire": None,
    "server_release": ("slots", "rate", "health"),
    "server_renew": None,
    "server_report": ("health", "probe"),
    "server_probe": None,
    "server_status": None,
}

#: Scripts in ``budget/lua``, one job each; ``_lib.lua`` is their shared prelude.
SCRIPT_NAMES: Final = tuple(SCRIPT_KEYS)

#: The field of ``budget.keys.DatasetKeys`` each dataset KEYS name stands for.
DATASET_KEY_FIELDS: Final[Mapping[str, str]] = {
    "ledger": "ledger_hash",
    "spec": "spec_str",
    "done": "done_hash",
    "failed": "failed_hash",
    "queued": "queued_zset",
    "leases": "lease_zset",
    "owners": "lease_owner_hash",
    "live": "live_hash",
    "reserved": "reserved_hash",
    "clock": "clock_hash",
    "pending": "pending_hash",
    "strikes": "strikes_hash",
    "rate_tokens": "rate_tokens_hash",
    "rate_samples": "rate_samples_hash",
    "lengths": "lengths_hash",
    "held": "held_hash",
}


#: The field of ``budget.keys.ServerKeys`` each server KEYS name stands for.
SERVER_KEY_FIELDS: Final[Mapping[str, str]] = {
    "slots": "slots_zset",
    "health": "health_hash",
    "rate": "rate_hash",
    "probe": "probe_str",
}


def keys_prelude(name: str) -> str:
    """The Lua line binding script ``name``'s KEYS to locals of their names (empty when variable)."""
    names = SCRIPT_KEYS[name]
    if not names:
        return ""
    return f"local {', '.join(names)} = {', '.join(f'KEYS[{i}]' for i in range(1, len(names) + 1))}\n"


def dataset_script_keys(name: str, keys: DatasetKeys, **others: str) -> list[str]:
    """Script ``name``'s KEYS for one dataset; a name that is not a dataset key comes from ``others``
    (the broker's queue list, say)."""
    names = SCRIPT_KEYS[name]
    assert names is not None, f"{name} takes variable KEYS"
    return [others[n] if n in others else getattr(keys, DATASET_KEY_FIELDS[n]) for n in names]


def server_script_keys(name: str, keys: ServerKeys) -> list[str]:
    """Script ``name``'s KEYS for one server."""
    names = SCRIPT_KEYS[name]
    assert names is not None, f"{name} takes variable KEYS"
    return [getattr(keys, SERVER_KEY_FIELDS[n]) for n in names]


@cache
def script_source(name: str) -> str:
    """The full text sent to Redis for script ``name``: the prelude, its KEYS locals, then the script."""
    lua = resources.files("budget") / "lua"
    return (lua / "_lib.lua").read_text() + "\n" + keys_prelude(name) + (lua / f"{name}.lua").read_text()


def register_scripts(client: redis.Redis) -> dict[str, Script]:
    return {name: client.register_script(script_source(name)) for name in SCRIPT_NAMES}
