"""Iteration-level scheduling for text generation: one decode loop's decisions, one step at a time.

`schedule(now)` plans a step: every running sequence decodes one token, and waiting requests are
prefilled and join, in turn by priority class then arrival, while the step's tokens stay within
`token_budget` (a decode feeds one token, a prefill its whole context padded to its length edge,
`prefill_edges`; a step's first prefill may pass it, else a long prompt could never run) and the
KV-cache tokens live after the step within `kv_bound`. With `prefill_apart` (the default) a step
that prefills anyone runs only its prefills, and the step after it decodes every running sequence
and lets nobody join: a joining request's first token then waits for no decode, and a running
sequence waits one prefill between two tokens either way (`make bench-generate BENCH_ARGS=--mixed`
measures both). Counted padded, every prefill the engine runs (one per edge: rows x edge) is a
shape of warmup/generation_profile.prefill_shapes, so warmup can run each one before READY. What
no longer fits is preempted: the lowest priority first, then the youngest (last to join); it goes
back to waiting and is recomputed from its prompt and the tokens it already has. A high-priority
request may preempt lower classes to join.
`finished(plan, outcome, now)` settles the step: a sequence leaves at end-of-sequence or at its
`max_new_tokens`; one whose step raised or gave NaN fails alone; out of memory lowers `kv_bound`
(learned, only ever down), and the next plan preempts down to it. Requests past their deadline
are expired (504); those that cannot fit even alone are refused (507); a full queue refuses at
submit (503).

Pure: no torch, no threads, no clock; time comes from the caller, so tests use a fake clock.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from tsbatch.handlers.core.errors import (BadInput, ConfigError, DeadlineExceeded, ModelFailed, OutOfMemory, Overloaded,
                                          ServingError)
from tsbatch.handlers.core.policy import Priority  # one X-Priority for every mode
from tsbatch.warmup.generation_profile import prefill_edge


class Status(enum.Enum):
    """Where a sequence is in its life: WAITING -> RUNNING (-> WAITING when preempted) -> one end."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"  # end-of-sequence or max_new_tokens: its tokens are its answer
    FAILED = "failed"  # its own error (model raised, NaN, expired, cannot fit): `error` says which
    CANCELLED = "cancelled"  # the client went away


@dataclass(frozen=True)
class GenerationRequest:
    """What a client asked for: prompt token ids, how many new tokens at most, when it arrived
    (monotonic seconds), its class and its deadline (monotonic seconds, None: none)."""

    rid: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrived: float
    priority: Priority = Priority.NORMAL
    deadline: float | None = None


@dataclass(eq=False)
class Seq:
    """One request's sequence as the scheduler tracks it: the tokens it has made so far (its
    answer), its status, and who waits for it (`waiter`, the engine's; opaque here)."""

    request: GenerationRequest
    waiter: Any = None
    tokens: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    error: ServingError | None = None
    stop: str = ""  # why it finished: "eos" or "length"
    joined: float = 0.0  # when it last joined the running set (the youngest is preempted first)
    first_token_at: float | None = None
    ended_at: float | None = None
    preemptions: int = 0

    @property
    def rid(self) -> str:
        return self.request.rid

    @property
    def priority(self) -> Priority:
        return self.request.priority

    @property
    def context(self) -> int:
        """KV-cache tokens this sequence holds after its next step (prompt plus tokens so far)."""
        return len(self.request.prompt) + len(self.tokens)

    @property
    def held(self) -> int:
        """KV-cache tokens it holds now: none while waiting, its context less the token not yet fed while running."""
        return self.context - 1 if self.status is Status.RUNNING else 0

    @property
    def most(self) -> int:
        """KV-cache tokens it can come to hold: prompt plus every token it may make."""
        return len(self.request.prompt) + self.request.max_new_tokens

    def effective_priority(self, now: float, aging: float) -> int:
        """The class it counts as when waiting: one better per `aging` seconds waited, so low never starves."""
        if aging <= 0:
            return int(self.priority)
        return max(0, int(self.priority) - math.floor((now - self.request.arrived) / aging))


@dataclass(frozen=True)
class GenerationSettings:
    token_budget: int  # tokens fed to the model per step: 1 per decode, a prefill's whole context
    kv_bound: int  # KV-cache tokens live after a step, all sequences together (the start; learned down)
    max_running: int  # sequences in one step at most
    queue_cap: int  # sequences waiting at most (preempted ones are not counted against it)
    priority_aging: float = 0.0  # seconds of waiting that raise a request one class (0: never)
    preempt_for_priority: bool = True  # a waiting request may preempt running ones of a lower class
    oom_backoff: float = 0.9  # out of memory: kv_bound becomes at most this share of the failed step's tokens
    prefill_edges: tuple[int, ...] = ()  # lengths a prefill pads its contexts to (ascending); (): to each context's own
    prefill_apart: bool = True  # joining sequences prefill in a step of their own, and the next step decodes

    def padded(self, context: int) -> int:
        """What prefilling a context of `context` tokens costs in the token budget: the edge it pads
        to (one past the last edge: itself; the handler refuses those before they get here)."""
        if not self.prefill_edges or context > self.prefill_edges[-1]:
            return context
        return prefill_edge(context, self.prefill_edges)

    def __post_init__(self):
        for name in ("token_budget", "kv_bound", "max_running", "queue_cap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"generation {name} must be a whole number of at least 1, got {value!r}")
        if self.token_budget < self.max_running:
            raise ConfigError(f"generation token_budget ({self.token_budget}) must be at least max_running "
                              f"({self.max_running}): every running sequence feeds one token a step")
        if not 0 < self.oom_backoff < 1:
            raise ConfigError(f"generation oom_backoff must be between 0 and 1, got {self.oom_backoff!r}")
        if self.priority_aging < 0:
            raise ConfigError(f"generation priority_aging must be 0 or more seconds, got {self.priority_aging!r}")
        if list(self.prefill_edges) != sorted(set(self.prefill_edges)) or any(e < 1 for e in self.prefill_edges):
            raise ConfigError(f"generation prefill_edges must ascend from 1, got {self.prefill_edges!r}")


@dataclass(frozen=True)
class StepPlan:
    """One step: `decode` feed their last token, `prefill` their whole context (prompt plus tokens
    so far) and join; `preempted` lost their seat and their KV cache (recomputed later); `expired`
    and `refused` leave now with their error. `tokens` fed (prefills padded to their edges) and
    `kv_tokens` live after the step."""

    decode: tuple[Seq, ...] = ()
    prefill: tuple[Seq, ...] = ()
    preempted: tuple[Seq, ...] = ()
    expired: tuple[Seq, ...] = ()
    refused: tuple[Seq, ...] = ()
    tokens: int = 0
    kv_tokens: int = 0

    @property
    def runs(self) -> tuple[Seq, ...]:
        return self.decode + self.prefill

    @property
    def ended(self) -> tuple[Seq, ...]:
        """Sequences this plan ends with an error, to be answered now."""
        return self.expired + self.refused


@dataclass(frozen=True)
class StepOutcome:
    """What running a plan gave: each sequence that ran its token, or its own failure; `eos`: the
    sequences whose token ends them (not kept); `out_of_memory`: the step as a whole ran out, and
    nothing advanced."""

    tokens: Mapping[Seq, int] = field(default_factory=dict)
    eos: frozenset = frozenset()
    failed: Mapping[Seq, ServingError] = field(default_factory=dict)
    out_of_memory: bool = False


def _victim_order(seq: Seq) -> tuple:
    """Preempted first: lowest class, then the youngest (last to join, then last to arrive)."""
    return (-int(seq.priority), -seq.joined, -seq.request.arrived)


class GenerationPolicy:
    """Waiting and running sequences, and the rules that plan each step and settle it."""

    def __init__(self, settings: GenerationSettings):
        self.settings = settings
        self.kv_bound = settings.kv_bound  # learned from out of memory: only goes down
        self.waiting: list[Seq] = []
        self.running: list[Seq] = []
        self.preemptions = 0
        self.out_of_memory_steps = 0
        self.prefilled_apart = False  # the last plan prefilled without decoding: the next one decodes

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def kv_in_use(self) -> int:
        return sum(seq.held for seq in self.running)

    def submit(self, request: GenerationRequest, waiter: Any = None) -> Seq:
        """Queue a request, or refuse it at once: Overloaded when the queue is full, OutOfMemory when
        it could not fit even alone (prompt plus max_new_tokens past the KV bound)."""
        if request.max_new_tokens < 1:
            raise BadInput(f"max_new_tokens must be at least 1, got {request.max_new_tokens}")
        if not request.prompt:
            raise BadInput("the prompt has no tokens")
        seq = Seq(request, waiter)
        if seq.most > self.kv_bound:
            raise self._cannot_fit(seq)
        fresh = sum(1 for s in self.waiting if s.preemptions == 0)
        if fresh >= self.settings.queue_cap:
            raise Overloaded(f"this worker has {fresh} generation requests waiting (cap {self.settings.queue_cap}): "
                             "retry shortly")
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Seq, now: float) -> bool:
        """The client went away: the sequence leaves wherever it is (a step in flight ignores it).
        True when it was still live."""
        if seq.status not in (Status.WAITING, Status.RUNNING):
            return False
        (self.waiting if seq.status is Status.WAITING else self.running).remove(seq)
        seq.status, seq.ended_at = Status.CANCELLED, now
        return True

    def schedule(self, now: float) -> StepPlan:
        """Plan the next step (see the module docstring for the rules, in the order applied here)."""
        expired = self._expire(now)
        preempted: list[Seq] = []
        refused: list[Seq] = []
        # waiting sequences that can never fit (the bound was learned lower after they came)
        for seq in [s for s in self.waiting if s.most > self.kv_bound]:
            self.waiting.remove(seq)
            refused.append(self._end(seq, self._cannot_fit(seq), now))
        # running sequences first: all decode, preempting down to the bound
        decode = list(self.running)
        kv = sum(seq.context for seq in decode)
        while kv > self.kv_bound and decode:
            victim = min(decode, key=_victim_order)
            if len(decode) == 1:  # alone and still past the bound: it cannot run at all
                self.running.remove(victim)
                refused.append(self._end(victim, self._cannot_fit(victim), now))
            else:
                self._preempt(victim)
                preempted.append(victim)
            decode.remove(victim)
            kv -= victim.context
        tokens = len(decode)
        prefill: list[Seq] = []
        aging = self.settings.priority_aging
        # after a step of prefills alone the running sequences (those joined in it too) decode before anyone joins
        joining = self.waiting if not (self.prefilled_apart and decode) else []
        for seq in sorted(joining, key=lambda s: (s.effective_priority(now, aging), s.request.arrived)):
            if seq in preempted:  # not back in the same step it lost its seat
                continue
            cost = self.settings.padded(seq.context)  # the step's prefills cost rows x edge per edge
            over_budget = prefill and tokens + cost > self.settings.token_budget  # one prefill may exceed it
            if over_budget:
                break
            seats = len(decode) + len(prefill) < self.settings.max_running
            if not seats or kv + seq.context > self.kv_bound:
                victims = self._make_room(seq, decode, kv, seats)
                if victims is None:
                    break  # in turn: later requests do not pass this one
                for victim in victims:
                    self._preempt(victim)
                    decode.remove(victim)
                    kv -= victim.context
                    tokens -= 1
                preempted.extend(victims)
            self.waiting.remove(seq)
            seq.status, seq.joined = Status.RUNNING, now
            self.running.append(seq)
            prefill.append(seq)
            kv += seq.context
            tokens += cost
        self.prefilled_apart = bool(self.settings.prefill_apart and prefill and decode)
        if self.prefilled_apart:  # they wait one prefill either way; the joining ones need not wait for their decode
            tokens -= len(decode)
            decode = []
        return StepPlan(tuple(decode), tuple(prefill), tuple(preempted), tuple(expired), tuple(refused), tokens, kv)

    def finished(self, plan: StepPlan, outcome: StepOutcome, now: float) -> list[Seq]:
        """Settle a step; returns the sequences that end now (finished or failed), to be answered.
        Sequences cancelled while the step ran are ignored."""
        live = [seq for seq in plan.runs if seq.status is Status.RUNNING]
        if outcome.out_of_memory:
            self.out_of_memory_steps += 1
            self.kv_bound = learned_bound(self.kv_bound, plan.kv_tokens, self.settings.oom_backoff)
            for seq in plan.prefill:  # never got a cache: back to waiting, not a preemption
                if seq.status is Status.RUNNING:
                    self.running.remove(seq)
                    seq.status = Status.WAITING
                    self.waiting.append(seq)
            return []
        unsettled = [seq for seq in live if seq not in outcome.tokens and seq not in outcome.failed]
        if unsettled:
            raise RuntimeError(f"the step's outcome names neither a token nor a failure for {len(unsettled)} of its "
                               f"{len(live)} sequences (first: {unsettled[0].rid})")
        ended = []
        for seq in live:
            error = outcome.failed.get(seq)
            if error is not None:
                self.running.remove(seq)
                ended.append(self._end(seq, error, now))
                continue
            if seq.first_token_at is None:
                seq.first_token_at = now
            if seq in outcome.eos:
                seq.stop = "eos"
            else:
                seq.tokens.append(outcome.tokens[seq])
                if len(seq.tokens) >= seq.request.max_new_tokens:
                    seq.stop = "length"
            if seq.stop:
                self.running.remove(seq)
                seq.status, seq.ended_at = Status.FINISHED, now
                ended.append(seq)
        return ended

    def _expire(self, now: float) -> list[Seq]:
        expired = []
        for pool in (self.waiting, self.running):
            for seq in [s for s in pool if s.request.deadline is not None and now >= s.request.deadline]:
                pool.remove(seq)
                expired.append(self._end(seq, DeadlineExceeded(
                    "this request could not finish before its deadline: raise X-Deadline-Ms or retry"), now))
        return expired

    def _make_room(self, seq: Seq, decode: list[Seq], kv: int, seats: bool) -> list[Seq] | None:
        """The running sequences of a lower class than `seq` whose preemption lets it join (a seat and
        its KV), in victim order; None when preemption is off or cannot make enough room."""
        if not self.settings.preempt_for_priority:
            return None
        victims: list[Seq] = []
        for victim in sorted((s for s in decode if s.priority > seq.priority), key=_victim_order):
            if seats and kv + seq.context <= self.kv_bound:
                break
            victims.append(victim)
            kv -= victim.context
            seats = True
        if not seats or kv + seq.context > self.kv_bound:
            return None
        return victims

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.append(seq)

    def _end(self, seq: Seq, error: ServingError, now: float) -> Seq:
        seq.status, seq.error, seq.ended_at = Status.FAILED, error, now
        return seq

    def _cannot_fit(self, seq: Seq) -> OutOfMemory:
        return OutOfMemory(f"this request needs up to {seq.most} KV-cache tokens (prompt {len(seq.request.prompt)} + "
                           f"max_new_tokens {seq.request.max_new_tokens}) and this worker holds {self.kv_bound}: "
                           "ask for fewer new tokens or a shorter prompt")


def learned_bound(kv_bound: int, kv_tokens: int, backoff: float) -> int:
    """The KV bound after a step holding `kv_tokens` ran out of memory: below that step, by `backoff`
    at least, and never up (warmup learns it by the same rule)."""
    return max(1, min(kv_bound, kv_tokens - 1, int(kv_tokens * backoff)))


def model_failed(error: BaseException) -> ModelFailed:
    """What a sequence whose own step raised is answered (500)."""
    return ModelFailed(f"the model failed on this request: {type(error).__name__}: {error}")


def produced_nan() -> ModelFailed:
    return ModelFailed("the model produced NaN for this request")
