"""Live control of a dataset from any machine that reaches Redis: pause, resume, revoke, re-budget.

The ledger's state is what every worker and the producer obey. On top of it, pausing or revoking purges
the dataset's waiting messages from the queue at once, and revoking asks each server to abort the
dataset's requests (by rid prefix), so nothing more is generated for it within moments.
"""

from __future__ import annotations

from budget import Ledger
from workers.aborts import abort_dataset
from workers.settings import QUEUE_NAME
from workers.sglang.client import SGLangClient


def pause(ledger: Ledger, name: str) -> tuple[str, int]:
    state = ledger.pause(name)
    return state, ledger.purge_queue(name, QUEUE_NAME, "paused")


def resume(ledger: Ledger, name: str) -> tuple[str, int]:
    return ledger.resume(name), 0


def revoke(ledger: Ledger, name: str) -> tuple[str, int]:
    state = ledger.revoke(name)
    purged = ledger.purge_queue(name, QUEUE_NAME, "revoked")
    servers = ledger.spec(name).get("servers") or []
    with SGLangClient(max_connections=4) as client:
        abort_dataset(client, name, servers)
    return state, purged


ACTIONS = {"pause": pause, "resume": resume, "revoke": revoke}
