"""What one generate task does with one sample: admit, stream, record, commit.

The order is what makes a crash harmless: the record is written (and flushed) before the ledger commit,
and the Celery message is acknowledged only after both (acks_late). A crash before the commit leaves a
record the ledger does not name (export ignores it) and a lease that expires, so the sample is fed again;
the commit is exactly-once per sample (the done hash), so a second generation is never counted twice.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from budget import Admission, GiveUpOutcome, Ledger, Progress, defaults
from budget.ledger import DatasetState
from budget.spec import DatasetSpec
from budget.urls import redact_url
from workers.conversation import Conversation, record_fields
from workers.leases import Lease, LeaseKeeper
from workers.output_guard import HAND_BACK_WAIT_S, OutputGuard
from workers.rids import new_rid
from workers.server_picker import PROBE_TIMEOUT_S, ServerPicker, SlotWaitCancelled
from workers.sglang.auth import MissingKey, server_auth
from workers.sglang.client import (
    Generation,
    ProtocolError,
    RequestRejected,
    ServerBusy,
    ServerUnavailable,
    SGLangClient,
    SGLangError,
    Unauthorized,
)
from workers.sink import OutputUnwritable, dataset_dir
from workers.stops import InflightRequests, StopWatcher

log = logging.getLogger(__name__)


def out_of_vocabulary(input_ids: list[int] | None, vocab_size: int | None) -> str | None:
    """Why ``input_ids`` must not be sent to a server whose model has ``vocab_size`` ids, or None."""
    if not input_ids or not vocab_size:
        return None
    low, high = min(input_ids), max(input_ids)
    if low >= 0 and high < vocab_size:
        return None
    bad = low if low < 0 else high
    return (
        f"input id {bad} is outside the model's vocabulary (ids 0 to {vocab_size - 1}): not sent, "
        "a real SGLang server crashes on it"
    )


def backoff_s(
    attempt: int, base_s: float = defaults.BACKOFF_BASE_S, cap_s: float = defaults.BACKOFF_CAP_S
) -> float:
    """Full-jitter exponential backoff before retry number ``attempt`` (1-based)."""
    return random.uniform(0, min(cap_s, base_s * 2 ** (attempt - 1)))


@dataclass(frozen=True, slots=True)
class Attempt:
    """One admitted try at one sample: what every step of the runner works on."""

    dataset: str
    sample: dict[str, Any]
    #: The sample's id, and this attempt's id (the one the ledger's done-set names if it commits).
    sid: str
    attempt: str
    spec: DatasetSpec
    lease: Lease
    #: ``output_dir/dataset``: where its record or failure is written.
    folder: Path


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a task reports (Flower shows it as the task's result)."""

    outcome: str
    reason: str = ""
    tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "reason": self.reason, "tokens": self.tokens}


class SampleRunner:
    def __init__(
        self,
        ledger: Ledger,
        client: SGLangClient,
        sink: Any,
        keeper: LeaseKeeper,
        lease_ms: int,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.ledger = ledger
        self.client = client
        self.sink = sink
        self.keeper = keeper
        self.lease_ms = lease_ms
        self.picker = ServerPicker(ledger.client, lease_ms, prober=self._probe_generation)
        self.inflight = InflightRequests()
        self.stops = StopWatcher(ledger, self.inflight, client)
        self.output_guard = OutputGuard(ledger, sink)
        self.sleep = sleep

    def _probe_generation(self, server: str) -> tuple[bool, str]:
        """Whether a down server generates again: one real one-token generation (not ``/health``, which a
        wedged engine may still answer with 200)."""
        try:
            self.client.generate(
                server,
                rid=new_rid("tokenfleet-probe"),
                sampling_params={"max_new_tokens": 1},
                text="ping",
                timeout_s=PROBE_TIMEOUT_S,
                stall_timeout_s=PROBE_TIMEOUT_S,
            )
        except SGLangError as e:
            return False, f"probe generation: {e.message}"
        return True, "probe generation answered"

    def run(self, dataset: str, sample: dict[str, Any]) -> Outcome:
        sid = str(sample["sample_id"])
        problem = self.output_guard.problem(dataset)
        if problem is not None:
            # This worker cannot write the dataset's output: no generation; the sample is fed again.
            self.sleep(HAND_BACK_WAIT_S)
            self.ledger.unqueue(dataset, [sid], "output_unwritable")
            return Outcome("dropped", f"output_unwritable: {problem}")
        attempt_id = uuid.uuid4().hex[:16]
        admitted = self.ledger.admit(dataset, sid, attempt_id, self.lease_ms)
        if admitted.admission is not Admission.OK or admitted.spec is None:
            return Outcome("dropped", admitted.admission.value)
        self.stops.start()
        spec = DatasetSpec.from_json(admitted.spec)
        output_dir = Path(spec.output_dir)
        folder = dataset_dir(output_dir, dataset)
        problem = self.output_guard.check_storage(dataset, folder, output_dir, spec.storage_token)
        if problem is not None:  # not the storage submit checked: records written here would be lost
            self.ledger.release(dataset, sid, attempt_id, "output_unwritable")
            return Outcome("dropped", f"output_unwritable: {problem}")
        lease = self.keeper.hold(dataset, sid, attempt_id)
        a = Attempt(dataset, sample, sid, attempt_id, spec, lease, folder)
        try:
            return self._generate(a)
        except OutputUnwritable as e:  # a failure record could not be written: as for a record
            self.output_guard.block(dataset, folder, e)
            self.ledger.release(dataset, sid, attempt_id, "output_unwritable")
            return Outcome("dropped", f"output_unwritable: {e.reason}")
        except BaseException:
            # Anything unplanned (a bug, a warm shutdown): give the sample back.
            self.ledger.release(dataset, sid, attempt_id, "worker_error")
            raise
        finally:
            self.keeper.drop(lease)

    def _progress(self, a: Attempt, new_tokens: int) -> tuple[Progress, str]:
        return self.ledger.progress(a.dataset, a.sid, a.attempt, new_tokens, self.lease_ms)

    def _generate(self, a: Attempt) -> Outcome:
        spec = a.spec
        sampling = dict(spec.sampling)
        last_error: SGLangError | None = None
        last_server: str | None = None
        conversation = Conversation.of(a.sample, spec, a.dataset)  # several replies (regenerate = "all")
        problem = out_of_vocabulary(a.sample.get("input_ids"), spec.vocab_size)
        if problem:  # the producer rejects such lines; this guards a server from one that got through
            return self._fail(a, problem, 0)
        first_try_at = time.monotonic()
        for try_no in range(1, spec.max_attempts + 1):
            if try_no > 1:
                wait_s = backoff_s(try_no - 1, spec.backoff_base_s, spec.backoff_cap_s)
                if try_no == spec.max_attempts:  # the last: no sooner than the minimum span (a restart)
                    wait_s = max(wait_s, first_try_at + spec.retry_min_span_s - time.monotonic())
                self.sleep(wait_s)
                verdict, state = self._progress(a, 0)
                if verdict is not Progress.CONTINUE or a.lease.lost.is_set():
                    kept = conversation.kept_tokens if conversation else 0
                    return self._give_back(a, state, verdict, kept)
            live = 0
            stop: tuple[Progress, str] | None = None

            def on_tokens(n: int) -> bool:
                nonlocal live, stop
                live += n
                if a.lease.lost.is_set():
                    stop = (Progress.LOST, "")
                    return False
                verdict, state = self._progress(a, n)
                if verdict is not Progress.CONTINUE:
                    stop = (verdict, state)
                    # The ledger told every worker process (Ledger.progress announces a stop): each
                    # aborts its own requests of the dataset by rid (workers/stops.py).
                    return False
                return True

            def keep_turn() -> None:
                # A finished reply of a conversation stays counted: the next try resumes after it.
                nonlocal live
                live = 0

            generate = self.client.generate
            if conversation is not None:
                generate = conversation.generator(self.client, keep_turn)
            # A busy server (it shed the request) is avoided for this retry but not counted as failing.
            failure = None if isinstance(last_error, ServerBusy) else last_error
            # Tracked from before it waits for a server slot: a stop meanwhile means it is never sent.
            with self.inflight.track(a.dataset, new_rid(a.dataset), "") as request:
                try:
                    with self.picker.use(
                        spec.servers,
                        avoid=last_server,
                        failure=failure,
                        caps=spec.max_inflight_per_server,
                        cancelled=lambda: request.handle.requested,
                    ) as server:
                        try:
                            self.client.set_auth(server, server_auth(spec.auth_of(server)))
                            gen = generate(
                                server,
                                rid=request.handle.rid,
                                sampling_params=sampling,
                                input_ids=a.sample.get("input_ids"),
                                text=a.sample.get("text"),
                                timeout_s=spec.timeout_s,
                                on_tokens=on_tokens,
                                stop=request.handle,
                                stall_timeout_s=spec.stall_timeout_s,
                            )
                        except (RequestRejected, ProtocolError) as e:
                            return self._fail(a, e.message, live)
                        except (Unauthorized, MissingKey) as e:
                            # This process holds no valid key for the server: not the sample's fault, nor
                            # the server's. Give the sample back for a worker that has the key.
                            log.error(
                                "%s: no valid API key for %s here: %s", a.dataset, redact_url(server), e
                            )
                            self._progress(a, -live)
                            kept = conversation.kept_tokens if conversation else 0
                            self.ledger.release(a.dataset, a.sid, a.attempt, "unauthorized", kept)
                            return Outcome("dropped", "unauthorized")
                        except ServerUnavailable as e:
                            last_error, last_server = e, server
                            self._progress(a, -live)
                            log.warning("%s/%s attempt %d: %s", a.dataset, a.sid, try_no, e)
                            continue
                except SlotWaitCancelled:
                    verdict, state = self._progress(a, 0)
                    kept = conversation.kept_tokens if conversation else 0
                    return self._give_back(a, state or request.handle.reason, verdict, kept)
            if stop is not None:
                verdict, state = stop
                return self._stopped(a, gen, verdict, state)
            if gen.aborted:
                # Aborted by a dataset-wide abort (budget reached, revoked) or by the server on its own
                # (retraction, restart): the ledger tells which.
                verdict, state = self._progress(a, 0)
                if verdict is not Progress.CONTINUE or a.lease.lost.is_set():
                    return self._stopped(a, gen, verdict, state)
                last_error = ServerUnavailable(
                    f"{redact_url(server)}: aborted by the server: {gen.finish_reason}"
                )
                last_server = server
                self._progress(a, -live)
                continue
            return self._record(a, gen, truncated=False)
        reason = f"gave up after {spec.max_attempts} attempts: {last_error.message if last_error else '?'}"
        return self._give_up(a, reason)

    def _stopped(self, a: Attempt, gen: Generation, verdict: Progress, state: str) -> Outcome:
        """We cut the generation: the budget was reached, the dataset revoked or paused, or the lease
        lost."""
        if verdict is Progress.CONTINUE:  # the lease keeper found the lease taken back
            verdict = Progress.LOST
        if verdict is Progress.STOP and state not in (DatasetState.REVOKED, DatasetState.PAUSED):
            if gen.completion_tokens == 0:  # stopped before its first token: nothing to keep or count
                return self._give_back(a, "budget", verdict, 0)
            if a.spec.on_budget == "truncate":
                return self._record(a, gen, truncated=True)
            self.ledger.release(
                a.dataset, a.sid, a.attempt, "discarded", gen.completion_tokens, counts_against_budget=True
            )
            return Outcome("discarded", "token budget reached", gen.completion_tokens)
        return self._give_back(a, state, verdict, gen.completion_tokens)

    def _give_back(self, a: Attempt, state: str, verdict: Progress, thrown_away: int) -> Outcome:
        reason = "lease_lost" if verdict is Progress.LOST else state or "stopped"
        self.ledger.release(a.dataset, a.sid, a.attempt, reason, thrown_away)
        return Outcome("dropped", reason, thrown_away)

    def _record(self, a: Attempt, gen: Generation, *, truncated: bool) -> Outcome:
        record = {
            "id": a.sid,
            "dataset": a.dataset,
            "input_ids": a.sample.get("input_ids"),
            "output_ids": gen.output_ids,
            "text": gen.text,
            "finish_reason": gen.finish_reason,
            "prompt_tokens": gen.prompt_tokens,
            "completion_tokens": gen.completion_tokens,
            "truncated": truncated,
            "meta": a.sample.get("meta") or {},
            "line_no": a.sample.get("line_no"),
            "attempt": a.attempt,
            "rid": gen.rid,
            "server": redact_url(gen.server),
            "created_at": time.time(),
        }
        record.update(record_fields(a.sample, gen))
        try:
            self.sink.write_record(a.folder, record, a.spec.fsync)
        except OutputUnwritable as e:
            # Not written, so not counted: the sample goes back to pending, and this worker takes no more
            # of the dataset's work until it can write there again.
            self.output_guard.block(a.dataset, a.folder, e)
            self.ledger.release(a.dataset, a.sid, a.attempt, "output_unwritable", gen.completion_tokens)
            return Outcome("dropped", f"output_unwritable: {e.reason}", gen.completion_tokens)
        outcome = self.ledger.commit(a.dataset, a.sid, a.attempt, gen.completion_tokens, truncated)
        return Outcome(
            outcome.value, "truncated at the token budget" if truncated else "", gen.completion_tokens
        )

    def _give_up(self, a: Attempt, reason: str) -> Outcome:
        """The servers kept failing: the sample goes back to pending (fed again later), and fails for good
        only after ``max_strikes`` tasks gave up on it."""
        given_up = self.ledger.give_up(a.dataset, a.sid, a.attempt, reason, 0, a.spec.max_strikes)
        if given_up is GiveUpOutcome.FAILED:
            self._write_failure(a, reason)
            return Outcome("failed", reason)
        return Outcome("dropped", f"server_unavailable: {reason}")

    def _fail(self, a: Attempt, reason: str, wasted: int) -> Outcome:
        self._write_failure(a, reason)
        self.ledger.fail(a.dataset, a.sid, a.attempt, reason, wasted)
        return Outcome("failed", reason, wasted)

    def _write_failure(self, a: Attempt, reason: str) -> None:
        failure = {
            "id": a.sid,
            "dataset": a.dataset,
            "line_no": a.sample.get("line_no"),
            "reason": reason,
            "attempt": a.attempt,
            "failed_at": time.time(),
        }
        self.sink.write_failure(a.folder, failure, a.spec.fsync)
