"""What a worker reads from the ledger for each task of a dataset: one frozen, documented type.

``submit`` builds it from the config (``tokenfleet.submit.dataset_spec``) and stores it as JSON with the
dataset (``Ledger.register``); every worker reads it back at each task (``DatasetSpec.from_json``), so a
worker never runs a stale config. Every field has its default here, from ``budget.defaults``: a spec
written by an older submit reads back with today's defaults, and a field this worker does not know is
ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from budget import defaults


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    """A dataset's generation settings, as every worker runs them.

    Attributes:
        servers: SGLang server URLs (or one sglang-router), in the config's order.
        output_dir: Where records and failures are written (``output_dir/NAME/part-*.jsonl``).
        sampling: The effective ``sampling_params`` sent with every request (a worker adds a
            ``stream_interval`` when it sets none, and lowers ``max_new_tokens`` to a budget's reservation).
        max_inflight_per_server: Generations in flight fleet-wide per server URL (None: no cap).
        timeout_s: Seconds a generation may take in all.
        stall_timeout_s: Seconds a stream may stay silent before it is given up as stalled.
        on_budget: ``truncate``, ``discard`` or ``drain`` at the token budget.
        fsync: ``always`` or ``never``.
        max_attempts: Attempts per task against retryable errors.
        max_strikes: Tasks that may give up on a sample before it fails for good.
        backoff_base_s, backoff_cap_s: Full-jitter exponential backoff between attempts.
        retry_min_span_s: A task's last attempt comes no sooner than this after its first.
        tokenizer: The target model's tokenizer (local folder or cached model id), for conversations.
        regenerate: ``last`` or ``all`` replies of a chat record.
        auth: Per server URL, where each process finds its API keys (``{"api_key": {"env": NAME}}``);
            names of variables or files, never keys.
        vocab_size: The model's vocabulary size (ids outside it are never sent), or None when unknown.
        storage_token: The token of submit's storage marker in ``output_dir`` (``budget.storage``).
    """

    servers: tuple[str, ...]
    output_dir: str
    sampling: Mapping[str, Any] = field(default_factory=dict)
    max_inflight_per_server: Mapping[str, int | None] = field(default_factory=dict)
    timeout_s: float = defaults.TIMEOUT_S
    stall_timeout_s: float = defaults.STALL_TIMEOUT_S
    on_budget: str = defaults.ON_BUDGET
    fsync: str = defaults.FSYNC
    max_attempts: int = defaults.MAX_ATTEMPTS
    max_strikes: int = defaults.MAX_STRIKES
    backoff_base_s: float = defaults.BACKOFF_BASE_S
    backoff_cap_s: float = defaults.BACKOFF_CAP_S
    retry_min_span_s: float = defaults.RETRY_MIN_SPAN_S
    tokenizer: str | None = None
    regenerate: str = defaults.REGENERATE
    auth: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    vocab_size: int | None = None
    storage_token: str | None = None

    def as_json(self) -> dict[str, Any]:
        """The JSON-ready dict stored in the ledger."""
        out = dataclasses.asdict(self)
        out["servers"] = list(self.servers)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DatasetSpec:
        """Read a stored spec; missing fields take their defaults, unknown ones are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known and v is not None}
        values["servers"] = tuple(data.get("servers") or ())
        values.setdefault("output_dir", str(data.get("output_dir") or ""))
        return cls(**values)

    def auth_of(self, server: str) -> Mapping[str, Any] | None:
        return self.auth.get(server)
