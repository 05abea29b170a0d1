"""The minimal synchronous scheduler: admit, reserve blocks, preempt, apply results.

Each step every running sequence feeds its uncomputed tokens (the whole prompt on admission,
then one token per step) and gets one sampled token back. When blocks run out, the newest
running sequence is preempted: its blocks are freed and it is recomputed later from its prompt
and outputs (its seeded noise is keyed by output position, so the result is unchanged).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.step_io import SeqResult, SeqStep
from scheduler.block_allocator import BlockAllocator
from scheduler.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192

    def __post_init__(self):
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, eos_token_ids: frozenset[int],
                 spec_tokens: int = 1, spec_slots: int = 0):
        """spec_tokens: most tokens one round may emit (draft depth + 1; 1 = no speculation);
        spec_slots: scratch slots a round needs past the committed length (tree + draft)."""
        self.config = config
        self.spec_tokens = spec_tokens
        self.spec_slots = spec_slots
        self.allocator = allocator
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # total, for metrics and tests

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Sequence]:
        """Pick this step's sequences and reserve KV room for their new tokens."""
        scheduled = self._schedule_running()
        budget = self.config.max_num_batched_tokens - len(scheduled)
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = seq.num_uncomputed
            if (n > budget and scheduled) or not self.allocator.can_reserve(seq.table, n):
                break
            self.waiting.popleft()
            self.allocator.reserve(seq.table, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(seq)
            budget -= n
        if not scheduled and self.waiting:
            seq = self.waiting[0]
            raise RuntimeError(f"KV cache too small: sequence {seq.seq_id} needs {seq.num_uncomputed} "
                               f"tokens, {self.allocator.num_free_blocks} free blocks of "
                               f"{self.allocator.block_size}")
        return scheduled

    def _schedule_running(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        for seq in list(self.running):
            if seq not in self.running:  # preempted below to make room for an older one
                continue
            while not self.allocator.can_reserve(seq.table, self._slots(seq)):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                self.allocator.reserve(seq.table, self._slots(seq))
                scheduled.append(seq)
        return scheduled

    def _slots(self, seq: Sequence) -> int:
        """Slots past the committed length this step may write: the uncomputed tokens, or a
        speculative round's scratch (never past the context)."""
        room = self.config.max_model_len - seq.table.num_committed
        return min(max(seq.num_uncomputed, self.spec_slots), room)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.table)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def steps(self, seqs: list[Sequence]) -> list[SeqStep]:
        """The engine's view of the scheduled sequences."""
        return [SeqStep(seq_id=s.seq_id, token_ids=s.token_ids(s.table.num_committed, s.num_tokens),
                        num_cached=s.table.num_committed, block_table=list(s.table.blocks),
                        params=s.params, seed=s.seed, output_token_ids=list(s.output_token_ids),
                        max_new_tokens=self.max_new_tokens(s), prompt_token_ids=s.prompt_token_ids)
                for s in seqs]

    def max_new_tokens(self, seq: Sequence) -> int:
        """Tokens a step may emit without passing max_tokens or the context (>= 1)."""
        left = min(seq.params.max_tokens - len(seq.output_token_ids),
                   self.config.max_model_len - seq.num_tokens)
        return max(1, min(left, self.spec_tokens))

    def update(self, seqs: list[Sequence], results: list[SeqResult]) -> None:
        """Commit the fed tokens and the accepted drafts, append the emitted tokens one by one
        (a burst stops at the first finishing token), finish what is done."""
        by_id = {r.seq_id: r for r in results}
        for seq in seqs:
            result = by_id[seq.seq_id]
            self.allocator.commit(seq.table, seq.num_uncomputed + result.num_accepted)
            seq.spec.add(result)
            for i, token in enumerate(result.token_ids):
                seq.output_token_ids.append(token)
                if result.logprobs is not None:
                    seq.output_logprobs.append(result.logprobs[i])
                self._check_finished(seq, token)
                if seq.is_finished:
                    break

    def _check_finished(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if token in p.stop_token_ids:
            self.finish(seq, FinishReason.STOP, token)
        elif token in self.eos_token_ids and not p.ignore_eos:
            self.finish(seq, FinishReason.STOP)
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            self.finish(seq, FinishReason.LENGTH)

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """End a sequence (also used for stop strings and aborts) and free its blocks now."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq.table)
        seq.finish(reason, stop_reason)
