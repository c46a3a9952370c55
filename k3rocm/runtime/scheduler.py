"""Continuous batching: waiting / running queues, chunked prefill under a token budget, decode, preemption.

One call of :meth:`Scheduler.schedule` plans one engine step, a mixed batch:

1. **running** sequences, oldest admission first: each gets the tokens it still has to compute
   (1 for a decoding sequence; a prefill chunk for one whose prompt is not done), bounded by the
   step's token budget (``max_num_batched_tokens``). When the MLA cache has no block for a running
   sequence, the most recently admitted running sequence is **preempted by recompute**: its blocks and
   KDA slot are freed, its computed-token count drops to 0, and it goes to the *front* of the waiting
   queue; on resumption its prompt plus the tokens it already generated are prefilled again (the
   generated tokens are kept, so the output does not change).
2. **waiting** sequences, first come first served (preempted ones first): admitted while the budget,
   ``max_num_seqs``, a free KDA slot and MLA blocks for the first chunk allow. Admission stops at the
   first sequence that does not fit (no overtaking: strict FCFS fairness).

:meth:`Scheduler.update` appends the sampled tokens of the sequences whose step ended at their last
known token, and finishes sequences on EOS (unless ``ignore_eos``) or ``max_tokens``.

Deterministic: no clocks, no randomness; the same calls give the same plans. Policy after vLLM's v1
scheduler (token-budget chunked prefill, recompute preemption).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from k3rocm.errors import ConfigError, PlanError
from k3rocm.runtime.cache import KDAStatePool, MLACache


class Status(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request's state.

    Attributes:
        seq_id: unique id.
        prompt: prompt token ids.
        max_tokens: output tokens to generate at most (>= 1).
        eos_token_id: ends the sequence when sampled (unless ``ignore_eos``); None = never.
        output: generated token ids.
        num_computed: tokens of ``prompt + output`` whose cache entries exist.
        status: waiting / running / finished.
        finish_reason: ``"eos"`` / ``"length"`` once finished.
        num_preemptions: times it was preempted.
        arrival: order of arrival (FCFS key).
    """

    seq_id: int
    prompt: list[int]
    max_tokens: int
    eos_token_id: int | None = None
    ignore_eos: bool = False
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    arrival: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def remaining(self) -> int:
        """Tokens still to compute before the next sample."""
        return self.num_tokens - self.num_computed


@dataclass(frozen=True)
class Scheduled:
    """One sequence's work in a step: compute tokens ``start .. start+num_tokens-1`` of ``seq.tokens``.

    ``sample`` is True when the chunk reaches the last known token, so the step yields its next token.
    """

    seq: Sequence
    start: int
    num_tokens: int
    sample: bool

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.start > 0 and self.sample


@dataclass
class SchedulerOutput:
    """The plan of one step: ``scheduled`` in batch order (decodes first, then prefill chunks) and the
    sequences preempted while planning it."""

    scheduled: list[Scheduled]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Continuous-batching scheduler over an :class:`MLACache` and a :class:`KDAStatePool`.

    Args:
        mla: block manager (may hold no layers; blocks are still accounted so the policy is uniform).
        kda: slot pool (its ``num_slots`` bounds the running sequences).
        max_num_seqs: running sequences at most.
        max_num_batched_tokens: tokens per step (decode tokens + prefill chunk tokens).
        long_prefill_threshold: longest chunk one sequence may take in a step (default: the budget).

    Raises:
        ConfigError: non-positive limits.
    """

    def __init__(self, mla: MLACache, kda: KDAStatePool, max_num_seqs: int = 8, max_num_batched_tokens: int = 512,
                 long_prefill_threshold: int | None = None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_seqs {max_num_seqs} and max_num_batched_tokens {max_num_batched_tokens} "
                              "must be >= 1")
        self.mla = mla
        self.kda = kda
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_threshold = long_prefill_threshold or max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []
        self._arrivals = 0
        self._ids: set[int] = set()

    # ------------------------------------------------------------------ requests
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of the waiting queue.

        Raises:
            ConfigError: empty prompt, ``max_tokens < 1`` or a duplicate id.
            PlanError: the sequence can never fit the cache (prompt + max_tokens over every block).
        """
        if not seq.prompt or seq.max_tokens < 1:
            raise ConfigError(f"request {seq.seq_id}: needs a non-empty prompt and max_tokens >= 1")
        if seq.seq_id in self._ids:
            raise ConfigError(f"request id {seq.seq_id} is already queued or running")
        if self.mla.layers and self.mla.blocks_for(len(seq.prompt) + seq.max_tokens) > self.mla.num_blocks:
            raise PlanError(f"request {seq.seq_id}: {len(seq.prompt)} + {seq.max_tokens} tokens exceed the whole MLA "
                            f"cache ({self.mla.num_blocks} x {self.mla.block_size}); raise the cache budget")
        seq.arrival = self._arrivals
        self._arrivals += 1
        seq.status = Status.WAITING
        self._ids.add(seq.seq_id)
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> Sequence | None:
        """Drop a sequence wherever it is, releasing its cache; returns it (None when unknown)."""
        for q in (self.running, self.waiting):
            for s in list(q):
                if s.seq_id == seq_id:
                    q.remove(s)
                    self._release(s)
                    s.status = Status.FINISHED
                    s.finish_reason = "abort"
                    self._ids.discard(seq_id)
                    return s
        return None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ planning
    def _release(self, seq: Sequence) -> None:
        self.mla.free(seq.seq_id)
        self.kda.free(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        return min(seq.remaining, budget, self.long_prefill_threshold)

    def schedule(self) -> SchedulerOutput:
        """Plan one step (see the module docstring). May return an empty plan only when nothing is queued.

        Raises:
            PlanError: a lone running sequence cannot get a block (the cache is smaller than one request).
        """
        budget = self.max_num_batched_tokens
        planned: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []

        # 1. running sequences, oldest admission first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            while not self.mla.can_allocate(seq.seq_id, seq.num_computed + n):
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:
                    raise PlanError(f"request {seq.seq_id}: MLA cache too small for one sequence "
                                    f"({self.mla.num_blocks} blocks); raise the cache budget")
                self._preempt(victim)
                preempted.append(victim)
                planned = [(s, k) for s, k in planned if s is not victim]
                if victim is seq:
                    break
            else:
                self.mla.allocate(seq.seq_id, seq.num_computed + n)
                planned.append((seq, n))
                budget -= n
                i += 1
                continue
            # seq itself was preempted: do not advance i (the list shrank)

        # 2. waiting sequences, FCFS, stop at the first that does not fit
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and self.kda.num_free > 0:
            seq = self.waiting[0]
            if any(seq is p for p in preempted):
                break  # never re-admit in the step that preempted it
            n = self._chunk(seq, budget)
            if not self.mla.can_allocate(seq.seq_id, n):
                break
            self.waiting.popleft()
            self.kda.allocate(seq.seq_id)
            self.mla.allocate(seq.seq_id, n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            planned.append((seq, n))
            budget -= n

        sched = [Scheduled(s, s.num_computed, n, s.num_computed + n == s.num_tokens) for s, n in planned]
        # decodes first, then prefill chunks (stable within each group)
        sched.sort(key=lambda x: 0 if x.is_decode else 1)
        return SchedulerOutput(sched, preempted)

    def update(self, out: SchedulerOutput, sampled: dict[int, int]) -> list[Sequence]:
        """Apply a step's results: advance computed counts, append ``sampled[seq_id]`` for sampling
        sequences, finish on EOS / ``max_tokens``. Returns the sequences finished by this step.

        Raises:
            ConfigError: a sampling sequence has no token in ``sampled``.
        """
        done = []
        for sc in out.scheduled:
            seq = sc.seq
            seq.num_computed += sc.num_tokens
            if not sc.sample:
                continue
            if seq.seq_id not in sampled:
                raise ConfigError(f"step result lacks the sampled token of request {seq.seq_id}")
            tok = int(sampled[seq.seq_id])
            seq.output.append(tok)
            reason = None
            if not seq.ignore_eos and seq.eos_token_id is not None and tok == seq.eos_token_id:
                reason = "eos"
            elif len(seq.output) >= seq.max_tokens:
                reason = "length"
            if reason:
                seq.status = Status.FINISHED
                seq.finish_reason = reason
                self.running.remove(seq)
                self._release(seq)
                self._ids.discard(seq.seq_id)
                self.finished.append(seq)
                done.append(seq)
        return done
