"""What one generate task does with one sample: admit, stream, record, commit.

The order is what makes a crash harmless: the record is written (and flushed) before the ledger commit,
and the Celery message is acknowledged only after both (acks_late). A crash before the commit leaves a
record the ledger does not name (export ignores it) and a lease that expires, so the sample is fed again;
the commit is exactly-once per sample (the done hash), so a second generation is never counted twice.
"""

from __future__ import annotations

import functools
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from budget import Admission, CommitItem, CommitOutcome, GiveUpOutcome, Ledger, Progress, defaults
from budget.ledger import (
    GRANT_AT_SEND,
    GRANT_DROPPED,
    GRANT_NOT_NOW,
    GRANT_WAIT,
    STOP_MAX_SAMPLES,
    DatasetState,
)
from budget.spec import DatasetSpec
from budget.urls import redact_url
from workers.batching import CallBatcher
from workers.continuation import (
    Grants,
    can_continue,
    continued_prompt,
    ended_at_grant,
    joined,
    requests_taken,
)
from workers.conversation import Conversation, ConversationGeneration, record_fields
from workers.leases import Lease, LeaseKeeper
from workers.output_guard import HAND_BACK_WAIT_S, OutputGuard, worst_record_bytes
from workers.rids import new_rid
from workers.server_picker import PROBE_TIMEOUT_S, ServerPicker, SlotWaitCancelled, unreachable
from workers.settings import server_wait_s_from_env
from workers.sglang.auth import MissingKey, server_auth
from workers.sglang.client import (
    Generation,
    ProtocolError,
    RequestRejected,
    ServerStalled,
    ServerUnavailable,
    SGLangClient,
    SGLangError,
    Unauthorized,
)
from workers.sink import OutputUnwritable, dataset_dir
from workers.stops import InflightRequests, StopWatcher
from workers.stream_pacing import PacedTooLong, StreamPacer

log = logging.getLogger(__name__)


def out_of_vocabulary(input_ids: list[int] | None, vocab_size: int | None) -> str | None:
    """Why ``input_ids`` must not be sent to a server whose model has ``vocab_size`` ids (unknown: no
    model has ``INPUT_ID_CEILING``), or None."""
    if not input_ids:
        return None
    vocab_size = vocab_size or defaults.INPUT_ID_CEILING
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


#: How long a finished generation's commit waits for others of this process to share its ledger call: at
#: least this, up to ``COMMIT_MAX_LINGER_S`` when generations end slowly (long answers), for batches of
#: about ``COMMIT_BATCH`` (a commit's Redis cost is mostly per call); never while every generation of the
#: process waits to commit, nor past the least for a commit the ledger's next admissions or grants wait on
#: (``commit_awaited``). The record is on disk by then and the server slot is free: only the count waits.
COMMIT_LINGER_S = 0.25
COMMIT_MAX_LINGER_S = 2.0
COMMIT_BATCH = 8
#: What SGLang generates at most when a request sets no ``max_new_tokens``.
DEFAULT_MAX_NEW_TOKENS = 128
#: A generation with its server slot whose budget is all granted to running generations (that give some
#: back as they end) asks again this often, for at most ``GRANT_WAIT_MAX_S``; then its sample goes back to
#: pending.
GRANT_WAIT_S = 0.02
GRANT_WAIT_MAX_S = 2.0
#: Why a sample is pending when its task gave it back because no server could be reached (refused
#: connections, every server dead): no fault of the sample's, so no strike; fed again once one is back.
SERVERS_DOWN = "servers_down"


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
    #: What the ledger granted it at admission under a token budget: truncate, ``GRANT_AT_SEND`` (granted
    #: once it has a server slot, and continued past its grant where the ledger grants more:
    #: ``workers/continuation.py``); 0: no budget, or discard and drain, which reserve nothing.
    cap: int = 0
    #: The most tokens it may produce (its reservation's want: max_new_tokens, or that times the replies
    #: of a conversation).
    want: int = 0


def commit_awaited(a: Attempt) -> bool:
    """Whether the ledger's next admissions or grants wait on this generation's commit, so that it lingers
    no longer than ``COMMIT_LINGER_S`` for others to share its call: under a truncate budget the commit
    gives back the rest of its reservation, which others near the budget's end wait for; discard and drain
    admit from the answers committed (their lengths) and count the generation in flight until its commit,
    so an answer that ended and lingered held its place while its server slot stood empty (a discard budget
    at 256 in flight ran 80-97 of them until its first answers' commits, lingering up to 2 s, came in)."""
    return a.cap != 0 or a.spec.on_budget in ("discard", "drain")


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of one sample: its task's result lists one per sample (Flower shows it)."""

    outcome: str
    reason: str = ""
    tokens: int = 0
    #: A recorded generation's finish reason as SGLang gave it (``stop``, ``length``, ``abort``).
    finish_reason: str = ""
    #: A recorded generation cut at the token budget.
    truncated: bool = False

    def as_dict(self) -> dict[str, Any]:
        shown: dict[str, Any] = {"outcome": self.outcome, "reason": self.reason, "tokens": self.tokens}
        if self.finish_reason:
            shown["finish_reason"] = self.finish_reason
        if self.truncated:
            shown["truncated"] = True
        return shown


class SampleRunner:
    def __init__(
        self,
        ledger: Ledger,
        client: SGLangClient,
        sink: Any,
        keeper: LeaseKeeper,
        lease_ms: int,
        sleep: Callable[[float], None] = time.sleep,
        server_wait_s: float | None = None,
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
        self.grants = Grants(ledger)
        #: Commits of this process's threads, grouped into one ledger call per dataset.
        self.committer: CallBatcher[str, CommitItem, CommitOutcome] = CallBatcher(
            "committer",
            ledger.commit_many,
            linger_s=COMMIT_LINGER_S,
            max_linger_s=COMMIT_MAX_LINGER_S,
            target_batch=COMMIT_BATCH,
            callers=lambda: self.keeper.count,
        )
        self.pacer = StreamPacer()
        self.sleep = sleep
        #: How long a generation waits while every server of its dataset is dead (``wait_reachable``).
        self.server_wait_s = server_wait_s_from_env() if server_wait_s is None else server_wait_s
        #: Each dataset's spec as last admitted: what a sample may want to reserve before it is admitted.
        self._specs: dict[str, DatasetSpec] = {}
        #: Servers that could not tokenize a text prompt as their /generate did (no /tokenize: a router
        #: that does not proxy it; or other ids): their text prompts are granted whole, not continued.
        self._no_tokenize: set[str] = set()

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

    def admit_many(
        self, dataset: str, samples: list[dict[str, Any]]
    ) -> tuple[list[Outcome | None], list[Attempt]]:
        """Admit ``samples`` (one task's) in one ledger call. Returns, per sample, its outcome when it was
        dropped (None when admitted), and the admitted ones' attempts, in order: each holds its lease and
        its reservation until ``run_admitted`` ends it."""
        sids = [str(s["sample_id"]) for s in samples]
        problem = self.output_guard.problem(dataset)
        if problem is not None:
            # This worker cannot write the dataset's output: no generation; the samples are fed again.
            self.sleep(HAND_BACK_WAIT_S)
            self.ledger.unqueue(dataset, sids, "output_unwritable")
            return [Outcome("dropped", f"output_unwritable: {problem}") for _ in samples], []
        attempt_ids = [uuid.uuid4().hex[:16] for _ in samples]
        wants = [self._want(dataset, s) for s in samples]
        wholes = [not can_continue(s) for s in samples]
        fit, problem = self._room_for(dataset, sids, samples, wants)
        if fit < len(samples):  # no room for the records of the rest: not generated, fed again
            if fit == 0:
                self.sleep(HAND_BACK_WAIT_S)
            self.ledger.unqueue(dataset, sids[fit:], "output_unwritable")
            for sid in sids[fit:]:  # set aside by an outer call of a group that fitted less here
                self.output_guard.finished(dataset, sid)
            rest: list[Outcome | None] = [
                Outcome("dropped", f"output_unwritable: {problem}") for _ in samples[fit:]
            ]
            if fit == 0:
                return rest, []
            head, attempts = self.admit_many(dataset, samples[:fit])
            return head + rest, attempts
        asks = list(zip(sids, attempt_ids, wants, wholes, strict=True))
        group = self.ledger.admit_many(dataset, asks, self.lease_ms)
        outcomes: list[Outcome | None] = [
            None if admission is Admission.OK else Outcome("dropped", admission.value)
            for admission, _ in group.results
        ]
        admitted = [i for i, o in enumerate(outcomes) if o is None]
        for i, o in enumerate(outcomes):
            if o is not None:
                self.output_guard.finished(dataset, sids[i])
        if not admitted:
            return outcomes, []
        if group.spec is None:  # cannot happen: the ledger sends the spec with any admission
            raise RuntimeError(f"{dataset}: admitted without a spec")
        self.stops.start()
        spec = DatasetSpec.from_json(group.spec)
        self._specs[dataset] = spec
        output_dir = Path(spec.output_dir)
        folder = dataset_dir(output_dir, dataset)
        problem = self.output_guard.check_storage(dataset, folder, output_dir, spec.storage_token)
        if problem is not None:  # not the storage submit checked: records written here would be lost
            for i in admitted:
                self.output_guard.finished(dataset, sids[i])
                self.ledger.release(dataset, sids[i], attempt_ids[i], "output_unwritable")
                outcomes[i] = Outcome("dropped", f"output_unwritable: {problem}")
            return outcomes, []
        attempts = [
            Attempt(
                dataset,
                samples[i],
                sids[i],
                attempt_ids[i],
                spec,
                self.keeper.hold(dataset, sids[i], attempt_ids[i]),
                folder,
                group.results[i][1],
                # the first group a process admits of a dataset learns its spec here: a conversation's
                # want was max_new_tokens alone, and its replies were cut at a third of what they needed
                want=wants[i] or self._want(dataset, samples[i]),
            )
            for i in admitted
        ]
        return outcomes, attempts

    def _room_for(
        self, dataset: str, sids: list[str], samples: list[dict[str, Any]], wants: list[int]
    ) -> tuple[int, str | None]:
        """How many of ``samples`` (the first ones) the output folder has room for, with the records this
        process has in flight, and why not the rest (``OutputGuard.admit_room``); all of them before this
        process has seen the dataset's spec."""
        spec = self._specs.get(dataset)
        if spec is None:
            return len(samples), None
        folder = dataset_dir(Path(spec.output_dir), dataset)
        worst = {
            sid: worst_record_bytes(sample, want or DEFAULT_MAX_NEW_TOKENS)
            for sid, sample, want in zip(sids, samples, wants, strict=True)
        }
        return self.output_guard.admit_room(dataset, folder, worst)

    def _want(self, dataset: str, sample: dict[str, Any]) -> int:
        """The most tokens ``sample``'s generation may produce, for its reservation: max_new_tokens, times
        the replies of a conversation that regenerates several (SGLang's default where the dataset sets
        none). 0 before this process has seen the dataset's spec: its admission sends it."""
        spec = self._specs.get(dataset)
        if spec is None:
            return 0
        max_new = int(spec.sampling.get("max_new_tokens") or 0)
        if max_new <= 0:
            max_new = DEFAULT_MAX_NEW_TOKENS
        try:
            conversation = Conversation.of(sample, spec, dataset)
        except Exception:  # a malformed conversation fails in _generate, with its reason
            return max_new
        return max_new * (conversation.replies if conversation is not None else 1)

    def run_admitted(self, a: Attempt) -> Outcome:
        """Generate, record and commit one admitted sample; its lease is dropped at the end."""
        try:
            return self._generate(a)
        except OutputUnwritable as e:  # a failure record could not be written: as for a record
            self.output_guard.block(a.dataset, a.folder, e)
            self.ledger.release(a.dataset, a.sid, a.attempt, "output_unwritable")
            return Outcome("dropped", f"output_unwritable: {e.reason}")
        except BaseException:
            # Anything unplanned (a bug, a warm shutdown): give the sample back.
            self.ledger.release(a.dataset, a.sid, a.attempt, "worker_error")
            raise
        finally:
            self.keeper.drop(a.lease)
            self.output_guard.finished(a.dataset, a.sid)

    def _progress(self, a: Attempt) -> tuple[Progress, str]:
        return self.ledger.progress(a.dataset, a.sid, a.attempt, self.lease_ms)

    def _generate(self, a: Attempt) -> Outcome:
        spec = a.spec
        sampling = dict(spec.sampling)
        last_error: SGLangError | None = None
        last_server: str | None = None
        # Whether a failure could be the sample's (not a server that could not be reached): a strike
        blamed = False
        conversation = Conversation.of(a.sample, spec, a.dataset)  # several replies (regenerate = "all")
        # of the budget, in all: grows where the ledger grants more (truncate: first granted at send time)
        grant = max(0, a.cap)
        if grant:
            self._cap_at(sampling, conversation, grant)
        if conversation is not None and a.cap == GRANT_AT_SEND:
            # every reply together is granted and continued (workers/conversation.py)
            conversation.want = a.want
            conversation.more = functools.partial(self.grants.more, a.dataset, a.sid, a.attempt)
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
                verdict, state = self._progress(a)
                if verdict is not Progress.CONTINUE or a.lease.lost.is_set():
                    kept = conversation.kept_tokens if conversation else 0
                    return self._give_back(a, state, verdict, kept)
            live = 0
            stop: tuple[Progress, str] | None = None
            a.lease.live = conversation.kept_tokens if conversation else 0

            def on_tokens(n: int) -> bool:
                # No ledger call per chunk: the lease keeper reports the live count every few seconds,
                # and stops (revoke, pause, a lowered budget) reach the stream by its rid
                # (workers/stops.py).
                nonlocal live, stop
                live += n
                a.lease.live += n
                if a.lease.lost.is_set():
                    stop = (Progress.LOST, "")
                    return False
                return True

            def keep_turn() -> None:
                # A finished reply of a conversation stays counted: the next try resumes after it.
                nonlocal live
                live = 0

            generate = self.client.generate
            if conversation is not None:
                generate = conversation.generator(self.client, keep_turn)
            # Tracked from before it waits for a server slot: a stop meanwhile means it is never sent.
            with self.inflight.track(a.dataset, new_rid(a.dataset), "") as request:
                try:
                    if not self.picker.wait_reachable(
                        spec.servers, self.server_wait_s, cancelled=lambda: request.handle.requested
                    ):
                        cause = f": {last_error.message}" if last_error else ""
                        down = f"every server down (refusing connections) for {self.server_wait_s:g} s{cause}"
                        return self._give_up(a, down, blamed)
                    with self.picker.use(
                        spec.servers,
                        avoid=last_server,
                        caps=spec.max_inflight_per_server,
                        cancelled=lambda: request.handle.requested,
                    ) as server:
                        if a.cap == GRANT_AT_SEND and grant == 0:
                            grant = self._start_grant(a, request.handle, server)
                            if grant <= 0:
                                return self._no_grant(a, grant)
                            self._cap_at(sampling, conversation, grant)
                        sent_max = int(sampling.get("max_new_tokens") or 0)
                        paced = self.pacer.open(server, sent_max, spec.stall_timeout_s)
                        if paced.speed > 0 and self._live_read_soon(a):  # cleared in the finally below
                            a.lease.pace = (paced.started, paced.speed, a.lease.live, sent_max)
                        try:
                            self.client.set_auth(server, server_auth(spec.auth_of(server)))
                            params = sampling
                            if "stream_interval" not in spec.sampling:
                                params = {**sampling, "stream_interval": paced.interval}
                            hearing = self.pacer.hearing(paced, on_tokens)
                            gen = generate(
                                server,
                                rid=request.handle.rid,
                                sampling_params=params,
                                input_ids=a.sample.get("input_ids"),
                                text=a.sample.get("text"),
                                timeout_s=spec.timeout_s,
                                on_tokens=hearing,
                                stop=request.handle,
                                stall_timeout_s=spec.stall_timeout_s,
                            )
                            if conversation is not None:  # its grant grew as its replies asked for more
                                grant = conversation.cap
                                if conversation.lost:
                                    stop = (Progress.LOST, "")
                            sent = int(params.get("max_new_tokens") or 0)
                            continuable = conversation is None and self._continuable(a, server)
                            prompt_ids: list[int] | None = None
                            while (
                                continuable
                                and 0 < grant < a.want
                                and stop is None
                                and ended_at_grant(gen, sent)
                            ):
                                # the grant ended it, not the answer: go on where the budget gives more
                                if prompt_ids is None:
                                    prompt_ids = self._prompt_ids(a, server, gen)
                                    if prompt_ids is None:  # a text prompt the server did not tokenize
                                        stop = (Progress.STOP, "")
                                        break
                                after = self.grants.more(a.dataset, a.sid, a.attempt, a.want - grant)
                                if after <= 0:
                                    stop = (Progress.LOST, "")
                                    break
                                if after <= grant:  # the budget has no more: cut, or thrown away
                                    stop = (Progress.STOP, "")
                                    break
                                sent, grant = after - grant, after
                                part = self.client.generate(
                                    server,
                                    rid=new_rid(a.dataset),
                                    sampling_params={**params, "max_new_tokens": sent},
                                    input_ids=continued_prompt(prompt_ids, gen),
                                    timeout_s=spec.timeout_s,
                                    on_tokens=hearing,
                                    stop=request.handle,
                                    stall_timeout_s=spec.stall_timeout_s,
                                )
                                gen = joined(gen, part)
                            if stop is None:
                                self._unused_back(a, gen, grant)
                            if not gen.aborted and not gen.stopped_by_us:
                                self.pacer.finished(paced, gen.completion_tokens)
                        except (RequestRejected, ProtocolError) as e:
                            return self._fail(a, e.message, live)
                        except (Unauthorized, MissingKey) as e:
                            # This process holds no valid key for the server: not the sample's fault, nor
                            # the server's. Give the sample back for a worker that has the key.
                            log.error(
                                "%s: no valid API key for %s here: %s", a.dataset, redact_url(server), e
                            )
                            kept = conversation.kept_tokens if conversation else 0
                            self.ledger.release(a.dataset, a.sid, a.attempt, "unauthorized", kept)
                            return Outcome("dropped", "unauthorized")
                        except ServerStalled as e:
                            last_error, last_server, blamed = e, server, True
                            if self.pacer.stalled(paced, live, spec.stall_timeout_s):
                                last_error = PacedTooLong(
                                    f"{e.message}, while it answered other streams: "
                                    f"the interval of {paced.interval} tokens was too long for its speed",
                                    server=server,
                                )
                            self.picker.failed(server, last_error)
                            log.warning("%s/%s attempt %d: %s", a.dataset, a.sid, try_no, last_error)
                            continue
                        except ServerUnavailable as e:
                            last_error, last_server = e, server
                            blamed = blamed or not unreachable(e)
                            self.picker.failed(server, e)
                            log.warning("%s/%s attempt %d: %s", a.dataset, a.sid, try_no, e)
                            continue
                        finally:
                            self.pacer.close(paced)
                            a.lease.pace = None  # over: its chunks counted what it produced
                except SlotWaitCancelled:
                    verdict, state = self._progress(a)
                    kept = conversation.kept_tokens if conversation else 0
                    return self._give_back(a, state or request.handle.reason, verdict, kept)
            if stop is not None:
                verdict, state = stop
                return self._stopped(a, gen, verdict, state)
            if gen.aborted:
                # Aborted by a dataset-wide abort (budget reached, revoked) or by the server on its own
                # (retraction, restart): the ledger tells which.
                verdict, state = self._progress(a)
                if verdict is not Progress.CONTINUE or a.lease.lost.is_set():
                    return self._stopped(a, gen, verdict, state)
                last_error = ServerUnavailable(
                    f"{redact_url(server)}: aborted by the server: {gen.finish_reason}"
                )
                last_server, blamed = server, True
                self.picker.failed(server, last_error)
                continue
            cut = self._cut_by_reservation(a, gen, grant)
            if cut and a.spec.on_budget == "discard":
                # one that cannot be continued (a text prompt a server cannot tokenize), granted what was
                # left at the budget's end, reached it: discard keeps no cut answer
                return self._stopped(a, gen, Progress.STOP, "")
            return self._record(a, gen, truncated=cut)
        reason = f"gave up after {spec.max_attempts} attempts: {last_error.message if last_error else '?'}"
        return self._give_up(a, reason, blamed)

    @staticmethod
    def _cap_at(sampling: dict[str, Any], conversation: Conversation | None, grant: int) -> None:
        """Send the generation with its grant of the budget as its limit: the server itself stops it there."""
        if conversation is not None:
            conversation.cap = grant
        else:
            sampling["max_new_tokens"] = min(int(sampling.get("max_new_tokens") or grant), grant)

    def _continuable(self, a: Attempt, server: str) -> bool:
        """Whether ``a``'s generation can go on past a grant on ``server``: a prompt of ids (a conversation's
        too: each reply is continued, workers/conversation.py), or a text prompt where the server tokenizes
        it for the continuation (``/tokenize``; a server that could not is not asked again by this
        process). One that cannot is granted its whole want (``GrantKind.WHOLE``): reserving every
        generation's max_new_tokens held a budget's concurrency to what is left over max_new_tokens."""
        if a.sample.get("input_ids"):
            return True
        return isinstance(a.sample.get("text"), str) and server not in self._no_tokenize

    def _prompt_ids(self, a: Attempt, server: str, gen: Generation) -> list[int] | None:
        """The ids of ``a``'s prompt as ``server`` saw them: the sample's own, or its text tokenized by the
        server (0.5.23, observed: /tokenize gives the ids /generate used), checked against the prompt's
        length the server reported for it. None where that fails: the answer is cut at its grant."""
        ids = a.sample.get("input_ids")
        if ids:
            return list(ids)
        tokens = self.client.tokenize(server, str(a.sample.get("text") or ""))
        if tokens is None or len(tokens) != gen.prompt_tokens:
            self._no_tokenize.add(server)
            got = "no /tokenize" if tokens is None else f"{len(tokens)} ids, not {gen.prompt_tokens}"
            log.warning(
                "%s: %s cannot tokenize text prompts for a continuation (%s): they are granted whole",
                a.dataset,
                redact_url(server),
                got,
            )
            return None
        return tokens

    def _live_read_soon(self, a: Attempt) -> bool:
        """Whether the ledger admits ``a``'s dataset from its live tokens now: a discard budget's first
        answers (``Renewal.soon``), or one not yet reported. Its requests are then counted at their
        expected speed between chunks (``Lease.reported``): paced for the stall timeout, on a server the
        process has measured, a stream's tokens reached the ledger only at its end, and the short answers
        that ended first were the measure of every answer (three budgets on one server at 256 in flight,
        after a run without budgets on the same workers: the first, 100k, started 506 generations on 2
        answers committed and threw away 62k tokens). A chunk a second instead cost up to 2.35x the time
        of a 10M budget at 1,024 in flight: 1,024 streams of cumulative ids."""
        return a.spec.on_budget == "discard" and self.keeper.live_wanted(a.dataset)

    def _start_grant(self, a: Attempt, handle: Any, server: str) -> int:
        """The first grant of a truncate budget's generation that has its server slot (``Grants.start``),
        asked again while the budget is all granted to generations that give some back as they end."""
        deadline = time.monotonic() + GRANT_WAIT_MAX_S
        while True:
            whole = not self._continuable(a, server)
            got = self.grants.start(a.dataset, a.sid, a.attempt, a.want, _slots_of(a.spec), whole)
            if got != GRANT_WAIT or handle.requested or time.monotonic() >= deadline:
                return GRANT_NOT_NOW if got == GRANT_WAIT else got
            self.sleep(GRANT_WAIT_S)

    def _unused_back(self, a: Attempt, gen: Generation, grant: int) -> None:
        """A truncate budget's generation that ended before its grant gives the rest back at once, before
        its slot goes to the next generation, which is granted from it."""
        if a.cap == GRANT_AT_SEND and not gen.aborted and gen.completion_tokens < grant:
            self.grants.end(a.dataset, a.sid, a.attempt, gen.completion_tokens)

    def _no_grant(self, a: Attempt, got: int) -> Outcome:
        """No grant for a generation with its slot: its lease was taken back (``got`` 0), the dataset was
        stopped, or the budget's end has come; never sent, its sample goes back to pending."""
        if got == GRANT_DROPPED:  # the grant call itself gave it back: no ledger call per sample
            return Outcome("dropped", Admission.LIMIT.value)
        verdict, state = self._progress(a)
        if got == 0 or verdict is not Progress.CONTINUE:
            return self._give_back(a, state, verdict, 0)
        self.ledger.release(a.dataset, a.sid, a.attempt, Admission.LIMIT.value)
        return Outcome("dropped", Admission.LIMIT.value)

    @staticmethod
    def _cut_by_reservation(a: Attempt, gen: Generation, grant: int) -> bool:
        """Whether the budget's grant (``grant`` tokens in all), not the dataset's max_new_tokens, ended
        the generation."""
        if not grant:
            return False
        if isinstance(gen, ConversationGeneration):
            return gen.cut_by_cap
        max_new = int(a.spec.sampling.get("max_new_tokens") or 0)
        reason = gen.finish_reason or {}
        return grant < max_new and reason.get("type") == "length" and gen.completion_tokens >= grant

    def _stopped(self, a: Attempt, gen: Generation, verdict: Progress, state: str) -> Outcome:
        """We cut the generation: the budget or the sample cap was reached, the dataset revoked or paused,
        or the lease lost."""
        if verdict is Progress.CONTINUE:  # the lease keeper found the lease taken back
            verdict = Progress.LOST
        if verdict is Progress.STOP and state == STOP_MAX_SAMPLES:
            # the sample cap was reached (lowered live below what ran): no commit could keep it
            return self._give_back(a, STOP_MAX_SAMPLES, verdict, gen.completion_tokens)
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

    @staticmethod
    def _hit_max_new(a: Attempt, gen: Generation, truncated: bool) -> bool:
        """Whether the generation (any reply of a conversation) ended at the dataset's ``max_new_tokens``:
        finish reason ``length`` at that many tokens. A sample cut at the budget (a reservation below
        max_new_tokens, or a stop) is ``truncated`` instead, and a ``length`` finish short of
        max_new_tokens (the server clamped it to the context left) is neither."""
        max_new = int(a.spec.sampling.get("max_new_tokens") or 0)
        if truncated or max_new <= 0:
            return False
        if isinstance(gen, ConversationGeneration):
            replies = [(t.get("finish_reason"), int(t.get("completion_tokens") or 0)) for t in gen.turns]
        else:
            replies = [(gen.finish_reason, gen.completion_tokens)]
        return any(
            isinstance(reason, dict) and reason.get("type") == "length" and tokens >= max_new
            for reason, tokens in replies
        )

    def _record(self, a: Attempt, gen: Generation, *, truncated: bool) -> Outcome:
        hit_max_new = self._hit_max_new(a, gen, truncated)
        record = {
            "id": a.sid,
            "dataset": a.dataset,
            "input_ids": a.sample.get("input_ids"),
            "output_ids": gen.output_ids,
            "text": gen.text,
            "finish_reason": gen.finish_reason,
            "prompt_tokens": gen.prompt_tokens,
            "completion_tokens": gen.completion_tokens,
            "reasoning_tokens": gen.reasoning_tokens,
            "truncated": truncated,
            "hit_max_new": hit_max_new,
            "meta": a.sample.get("meta") or {},
            "line_no": a.sample.get("line_no"),
            "attempt": a.attempt,
            "rid": gen.rid,
            "requests": requests_taken(gen),
            "server": redact_url(gen.server),
            "created_at": time.time(),
        }
        record.update(record_fields(a.sample, gen))
        try:
            self.sink.write_record(a.folder, record, a.spec.fsync)
        except OutputUnwritable as e:
            # Not written, so not counted yet: the record is held in the ledger and written once room
            # comes back (by any worker), not generated again; past the cap on held records, the sample
            # goes back to pending. This worker takes no more of the dataset's work until it can write.
            self.output_guard.block(a.dataset, a.folder, e)
            self.keeper.drop(a.lease)  # its lease is kept without expiry now: no renewal of it
            if self.output_guard.hold(a.dataset, a.sid, a.attempt, record, gen.completion_tokens):
                return Outcome("held", f"output_unwritable: {e.reason}", gen.completion_tokens)
            self.ledger.release(a.dataset, a.sid, a.attempt, "output_unwritable", gen.completion_tokens)
            return Outcome("dropped", f"output_unwritable: {e.reason}", gen.completion_tokens)
        outcome = self.committer.call(
            a.dataset,
            CommitItem(
                a.sid,
                a.attempt,
                gen.completion_tokens,
                truncated,
                reasoning_tokens=gen.reasoning_tokens,
                hit_max_new=hit_max_new,
            ),
            hurry=commit_awaited(a),
        )
        return Outcome(
            outcome.value,
            "truncated at the token budget" if truncated else "",
            gen.completion_tokens,
            finish_reason=str((gen.finish_reason or {}).get("type") or ""),
            truncated=truncated,
        )

    def _give_up(self, a: Attempt, reason: str, blamed: bool = True) -> Outcome:
        """The servers kept failing: the sample goes back to pending (fed again later), and fails for good
        only after ``max_strikes`` tasks gave up on it. When no failure could be the sample's (``blamed``
        False: every one a server that could not be reached, or every server dead), it goes back without a
        strike (``SERVERS_DOWN``): a dead server is no fault of the sample's."""
        if not blamed:
            self.ledger.release(a.dataset, a.sid, a.attempt, SERVERS_DOWN)
            return Outcome("dropped", f"{SERVERS_DOWN}: {reason}")
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


def _slots_of(spec: DatasetSpec) -> int:
    """The slots of the dataset's servers, fleet-wide, as its spec gives them (0: some server has no cap)."""
    caps = [spec.max_inflight_per_server.get(url) for url in spec.servers]
    return sum(c for c in caps if c) if caps and all(caps) else 0
