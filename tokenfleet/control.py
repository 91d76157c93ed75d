"""Live control of a dataset from any machine that reaches Redis: pause, resume, revoke, re-budget.

The ledger's state is what every worker and the producer obey. Pausing or revoking also purges the
dataset's waiting messages from the queue at once, and the ledger announces the stop to every worker
process, each of which aborts its own in-flight requests of the dataset by their rids within a second
(``workers/stops.py``): a real SGLang server has no abort by prefix.
"""

from __future__ import annotations

from typing import Final

from pydantic import TypeAdapter, ValidationError

from budget import Ledger
from tokenfleet.config.models import PositiveInt
from workers.messages import QUEUE_NAME

#: A limit set live obeys the rule of ``token_budget`` and ``max_samples`` in a config (``PositiveInt``).
_LIMIT: Final = TypeAdapter(PositiveInt)


class LimitError(ValueError):
    """A limit a config would refuse, given live (one user-facing line)."""


#: ``tokenfleet budget``'s words for a limit left as it is, and for a limit removed.
KEEP: Final = "-"
NO_LIMIT: Final = "none"


def live_limit(value: str, what: str) -> int | str | None:
    """A limit as ``tokenfleet budget`` takes it: a number (``checked_limit``), ``-`` (``KEEP``: leave
    it as it is) or ``none`` (``NO_LIMIT``: remove it), for ``Ledger.set_limits``."""
    if value == KEEP:
        return KEEP
    if value.lower() == NO_LIMIT:
        return None
    try:
        number = int(value.replace("_", "").replace(",", ""))
    except ValueError:
        raise LimitError(
            f"{what}: a whole number of {'tokens' if what == 'tokens' else 'samples'}, "
            f"'{KEEP}' to leave it as it is, or '{NO_LIMIT}' to remove it (got {value!r})"
        ) from None
    return checked_limit(number, what)


def checked_limit(value: int, what: str) -> int:
    """``value`` as a token budget or sample cap (``what`` names the argument), or ``LimitError`` with the
    config's own wording: ``tokens: input should be greater than or equal to 1 (got -5)``."""
    try:
        return _LIMIT.validate_python(value)
    except ValidationError as e:
        message = str(e.errors()[0]["msg"])
        raise LimitError(f"{what}: {message[:1].lower()}{message[1:]} (got {value})") from None


def pause(ledger: Ledger, name: str) -> tuple[str, int]:
    state = ledger.pause(name)
    return state, ledger.purge_queue(name, QUEUE_NAME, "paused")


def resume(ledger: Ledger, name: str) -> tuple[str, int]:
    return ledger.resume(name), 0


def revoke(ledger: Ledger, name: str) -> tuple[str, int]:
    state = ledger.revoke(name)
    return state, ledger.purge_queue(name, QUEUE_NAME, "revoked")


ACTIONS = {"pause": pause, "resume": resume, "revoke": revoke}
