"""Loads the ledger's Lua scripts once per Redis client, each with the shared helpers prepended."""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Final

import redis
from redis.commands.core import Script

#: Scripts in ``budget/lua``, one job each; ``_lib.lua`` is their shared prelude.
SCRIPT_NAMES: Final = (
    "register",
    "set_limits",
    "set_state",
    "enqueue",
    "unqueue",
    "admit",
    "progress",
    "stop_check",
    "output_problem",
    "renew",
    "commit",
    "fail",
    "release",
    "reclaim",
    "set_source",
    "snapshot",
    "purge_queue",
    "give_up",
    "audit_queued",
    "clear_pending",
    "heartbeat",
    "server_acquire",
    "server_release",
    "server_renew",
    "server_report",
    "server_probe",
    "server_status",
)


@cache
def script_source(name: str) -> str:
    """The full text sent to Redis for script ``name``: the prelude, then the script."""
    lua = resources.files("budget") / "lua"
    return (lua / "_lib.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


def register_scripts(client: redis.Redis) -> dict[str, Script]:
    return {name: client.register_script(script_source(name)) for name in SCRIPT_NAMES}
