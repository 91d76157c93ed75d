"""The ledger's exceptions. Callers see these, never a redis-py traceback."""

from __future__ import annotations


class LedgerError(Exception):
    """Root of every ledger error."""


class LedgerUnavailable(LedgerError):
    """Redis did not answer (connection refused, timeout, auth failure)."""


class UnknownDataset(LedgerError):
    """The dataset was never registered in this ledger."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown dataset {name!r}: it was never submitted to this ledger")
        self.name = name
