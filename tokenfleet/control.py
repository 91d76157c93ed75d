"""Live control of a dataset from any machine that reaches Redis: pause, resume, revoke, re-budget.

The ledger's state is what every worker and the producer obey. Pausing or revoking also purges the
dataset's waiting messages from the queue at once, and the ledger announces the stop to every worker
process, each of which aborts its own in-flight requests of the dataset by their rids within a second
(``workers/stops.py``): a real SGLang server has no abort by prefix.
"""

from __future__ import annotations

from budget import Ledger
from workers.messages import QUEUE_NAME


def pause(ledger: Ledger, name: str) -> tuple[str, int]:
    state = ledger.pause(name)
    return state, ledger.purge_queue(name, QUEUE_NAME, "paused")


def resume(ledger: Ledger, name: str) -> tuple[str, int]:
    return ledger.resume(name), 0


def revoke(ledger: Ledger, name: str) -> tuple[str, int]:
    state = ledger.revoke(name)
    return state, ledger.purge_queue(name, QUEUE_NAME, "revoked")


ACTIONS = {"pause": pause, "resume": resume, "revoke": revoke}
