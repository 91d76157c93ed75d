"""The dataset ledger in Redis: limits, state, counters, done-set and leases.

Every change goes through one of the Lua scripts in ``budget/lua`` (atomic); every key name comes from
``budget.keys``. This package imports only redis-py.
"""

from budget.errors import LedgerError, LedgerUnavailable, UnknownDataset
from budget.ledger import (
    Admission,
    CommitItem,
    CommitOutcome,
    DatasetLimits,
    DatasetSnapshot,
    DatasetState,
    FailOutcome,
    GiveUpOutcome,
    GrantAsk,
    GrantKind,
    GroupAdmission,
    HoldOutcome,
    Ledger,
    Progress,
    ReleaseOutcome,
    connect,
)

__all__ = [
    "Admission",
    "CommitItem",
    "CommitOutcome",
    "DatasetLimits",
    "DatasetSnapshot",
    "DatasetState",
    "FailOutcome",
    "GiveUpOutcome",
    "GrantAsk",
    "GrantKind",
    "GroupAdmission",
    "HoldOutcome",
    "Ledger",
    "LedgerError",
    "LedgerUnavailable",
    "Progress",
    "ReleaseOutcome",
    "UnknownDataset",
    "connect",
]
