"""The scheduler: admission, chunked prefill, prefix reuse, preemption, tree budgets, results.

Each step: every running sequence feeds its uncomputed tokens - a prefill chunk of at most
`max_prefill_chunk` tokens (so running decodes never wait behind a long prompt), or its one
new token - then waiting sequences are admitted FCFS while the running-sequence limit, the
batched-token budget and the free KV blocks allow. An admitted sequence first takes the longest
run of its full blocks found in the prefix cache. When blocks run out, the newest running
sequence is preempted: its blocks are freed and it is recomputed later from its prompt and
outputs (its seeded noise is keyed by output position, so the result is unchanged; its own
blocks usually come back from the prefix cache). Then the tree-budget policy gives every
decoding sequence its number of tokens to verify this round (1 = no speculation).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from eagle_serve.engine.step_io import SeqResult, SeqStep
from eagle_serve.scheduler.block_allocator import BlockAllocator
from eagle_serve.scheduler.budget.interface import BudgetPolicy
from eagle_serve.scheduler.sequence import FinishReason, Sequence, SequenceStatus


class KVCacheTooSmall(RuntimeError):
    """The sequence `seq_id` cannot fit in the KV cache even with nothing else running."""

    def __init__(self, seq_id: int, message: str):
        super().__init__(message)
        self.seq_id = seq_id


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_prefill_chunk: int = 512  # prompt tokens one sequence feeds per step

    def __post_init__(self):
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, eos_token_ids: frozenset[int],
                 spec_tokens: int = 1, spec_slots: int = 0, budget: BudgetPolicy | None = None,
                 tree_tokens: int | None = None):
        """spec_tokens: most tokens one round may emit (draft depth + 1; 1 = no speculation);
        spec_slots: scratch slots a round needs past the committed length (tree + draft);
        budget: the policy choosing each round's trees (None: always the full tree);
        tree_tokens: the configured tree, root included (None: spec_tokens), which a step's
        trees are cut down from when max_num_batched_tokens would not hold them all."""
        self.config = config
        self.spec_tokens = spec_tokens
        self.tree_tokens = tree_tokens or spec_tokens
        self.spec_slots = spec_slots
        self.release_scratch = True  # plain rounds give their scratch back (False: for benchmarks)
        self.budget = budget
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
        """Pick this step's sequences, reserve KV room for their tokens, choose tree sizes."""
        budget = self.config.max_num_batched_tokens
        scheduled = self._schedule_running(budget)
        budget -= sum(s.num_scheduled for s in scheduled)
        caching = self.allocator.enable_prefix_caching
        inflight = {h for s in scheduled if s.num_uncomputed > 1 for h in self._new_hashes(s)} if caching else set()
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            looked_up = 0
            # (without prefix caching there is nothing to look up, nor to wait for: sequences
            # sharing a first block were admitted one a step, and every lookup counted a miss)
            if caching and seq.table.num_committed == 0 and not seq.table.blocks:
                hashes = seq.block_hashes(self.allocator.block_size, seq.num_tokens - 1)
                nxt = next((i for i, h in enumerate(hashes) if not self.allocator.cached(h)), len(hashes))  # the leading run
                if nxt < len(hashes) and hashes[nxt] in inflight and scheduled:
                    break  # its next block is being computed now: take it from the cache next step
                self.allocator.match_prefix(seq.table, hashes)
                looked_up = len(hashes) * self.allocator.block_size
            n = min(seq.num_uncomputed, self.config.max_prefill_chunk, budget)
            # everything but the last token came from the cache: a recomputed sequence's last
            # output token decodes (and may speculate); a prompt's is computed as a prompt
            slots = self._slots(seq) if seq.decodes_next else n
            if not self.allocator.can_reserve(seq.table, slots):
                if not scheduled and not self.running:
                    self.allocator.free(seq.table)
                    raise KVCacheTooSmall(seq.seq_id, f"KV cache too small: sequence {seq.seq_id} needs {n} tokens, "
                                       f"{self.allocator.num_free_blocks} free blocks of {self.allocator.block_size}")
                self.allocator.free(seq.table)  # drop the prefix hold; it is taken again when admitted
                break
            self.waiting.popleft()
            self.allocator.reserve(seq.table, slots)
            if looked_up:  # counted once admitted (a sequence that waits for room is looked up every step)
                self.allocator.count_lookup(looked_up, seq.table.num_committed)
            seq.status = SequenceStatus.RUNNING
            seq.num_scheduled, seq.tree_tokens, seq.tree_depth, seq.restart = n, None, None, True
            self.running.append(seq)
            scheduled.append(seq)
            if caching:
                inflight.update(self._new_hashes(seq))
            budget -= n
        self._choose_trees(scheduled)
        self._release_unused_scratch(scheduled)
        return scheduled

    def _release_unused_scratch(self, scheduled: list[Sequence]) -> None:
        """A decoding sequence the budget decodes plainly this round writes one slot: its
        scratch reservation goes back before the step, so a plain round holds the blocks an
        engine without speculation holds (held scratch scatters the blocks plain rounds read)."""
        if self.spec_slots <= 1 or not self.release_scratch:
            return
        for s in scheduled:
            if s.num_scheduled == 1 and s.tree_tokens == 1:
                self.allocator.rollback(s.table)
                self.allocator.reserve(s.table, 1)

    def _new_hashes(self, seq: Sequence) -> list[bytes]:
        bs = self.allocator.block_size
        start = seq.table.num_committed // bs
        return seq.block_hashes(bs, seq.table.num_committed + seq.num_scheduled)[start:]

    def _schedule_running(self, budget: int) -> list[Sequence]:
        scheduled: list[Sequence] = []
        for seq in list(self.running):
            if seq not in self.running:  # preempted below to make room for an older one
                continue
            if seq.num_uncomputed > 1:  # a prompt still prefilling, chunk by chunk
                n = min(seq.num_uncomputed, self.config.max_prefill_chunk, max(budget, 0))
                if n == 0:
                    continue
                slots = n
            else:
                n, slots = 1, self._slots(seq) if seq.decodes_next else 1
            while not self.allocator.can_reserve(seq.table, slots):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                self.allocator.reserve(seq.table, slots)
                seq.num_scheduled, seq.tree_tokens, seq.tree_depth, seq.restart = n, None, None, False
                scheduled.append(seq)
                budget -= n
        return scheduled

    def _slots(self, seq: Sequence) -> int:
        """Slots past the committed length a decode step may write: a speculative round's
        scratch (never past the context)."""
        room = self.config.max_model_len - seq.table.num_committed
        return max(1, min(self.spec_slots, room))

    def _choose_trees(self, scheduled: list[Sequence]) -> None:
        for s in scheduled:  # (a one-token chunk of a longer prompt had been given a tree, with one slot)
            s.decoding = s.num_scheduled == 1 and s.decodes_next
        decoding = [s for s in scheduled if s.decoding]
        if self.spec_tokens <= 1 or not decoding:
            return
        prefill = sum(s.num_scheduled for s in scheduled) - len(decoding)
        # a round writes up to spec_slots past the committed length (the tree, the head's
        # frontier); where the context ends `_slots` reserves only the room left, and a full tree
        # wrote past the block table into block 0 (another sequence's or the prefix cache's):
        # such a sequence decodes plainly
        short = [self._slots(s) < self.spec_slots for s in decoding]
        if self.budget is None:
            sizes = [1 if x else None for x in short]
            depths, sync = [None] * len(decoding), [True] * len(decoding)
        else:
            remaining = [self.tokens_left(s) for s in decoding]
            caps = [1 if x else min(r, self.spec_tokens) for r, x in zip(remaining, short)]  # max_new_tokens
            plan = self.budget.choose(caps, prefill, backlogs=[s.head_backlog for s in decoding], remaining=remaining)
            sizes, depths, sync = list(plan.sizes), list(plan.depths), plan.sync
        # the step's tokens (prefill chunks, then each tree) stay within max_num_batched_tokens:
        # the trees share what the decodes' own tokens leave, the largest cut first
        full = [self.tree_tokens if x is None else x for x in sizes]
        room = self.config.max_num_batched_tokens - prefill - len(decoding)
        if sum(f - 1 for f in full) > room:
            sizes = [1 + x for x in _fit([f - 1 for f in full], max(room, 0))]
            depths = [None if d is None else min(d, n - 1) for d, n in zip(depths, sizes)]
        for s, size, depth, keep in zip(decoding, sizes, depths, sync):
            s.tree_tokens = size  # None: the engine's configured tree
            s.tree_depth = depth
            s.head_sync = keep

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.table)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def steps(self, seqs: list[Sequence]) -> list[SeqStep]:
        """The engine's view of the scheduled sequences."""
        out = []
        for s in seqs:
            start = s.table.num_committed
            out.append(SeqStep(seq_id=s.seq_id, token_ids=s.token_ids(start, start + s.num_scheduled),
                               num_cached=start, block_table=list(s.table.blocks), params=s.params, seed=s.seed,
                               output_token_ids=list(s.output_token_ids),
                               sample=start + s.num_scheduled == s.num_tokens,
                               max_new_tokens=self.max_new_tokens(s), prompt_token_ids=s.prompt_token_ids,
                               tree_tokens=s.tree_tokens, tree_depth=s.tree_depth, restart=s.restart,
                               head_sync=s.head_sync))
        return out

    def max_new_tokens(self, seq: Sequence) -> int:
        """Tokens a step may emit without passing max_tokens or the context (>= 1)."""
        return min(self.tokens_left(seq), self.spec_tokens)

    def tokens_left(self, seq: Sequence) -> int:
        """Tokens the sequence may still emit before max_tokens or the context (>= 1)."""
        return max(1, min(seq.params.max_tokens - len(seq.output_token_ids), self.config.max_model_len - seq.num_tokens))

    def update(self, seqs: list[Sequence], results: list[SeqResult]) -> None:
        """Commit the fed tokens and the accepted drafts, append the emitted tokens one by one
        (a burst stops at the first finishing token), finish what is done."""
        by_id = {r.seq_id: r for r in results}
        bs = self.allocator.block_size
        for seq in seqs:
            if seq.is_finished:
                continue
            result = by_id.get(seq.seq_id)
            accepted = result.num_accepted if result is not None else 0
            self.allocator.commit(seq.table, seq.num_scheduled + accepted)
            seq.num_scheduled = 0
            done = None
            if result is not None:
                seq.spec.add(result)
                seq.head_backlog = result.head_backlog
                if self.budget is not None and result.num_draft_tokens:
                    self.budget.observe(result.draft_confidence, result.num_draft_tokens + 1, result.num_accepted,
                                        result.draft_depths, result.draft_depth)
                for i, token in enumerate(result.token_ids):
                    seq.output_token_ids.append(token)
                    if result.logprobs is not None:
                        seq.output_logprobs.append(result.logprobs[i])
                    done = self._finish_reason(seq, token)
                    if done is not None:
                        break
            # publish full blocks before a finish frees them: a later request may share them
            if self.allocator.enable_prefix_caching:
                self.allocator.register(seq.table, seq.block_hashes(bs, seq.table.num_committed))
            if done is not None:
                self.finish(seq, *done)

    def fail(self, seqs: list[Sequence]) -> None:
        """A step that raised: nothing it wrote is kept (the reserved slots are rolled back)."""
        for seq in seqs:
            seq.num_scheduled = 0
            if seq.table.blocks:
                self.allocator.rollback(seq.table)

    def _finish_reason(self, seq: Sequence, token: int):
        p = seq.params
        if token in p.stop_token_ids:
            return FinishReason.STOP, token
        if token in self.eos_token_ids and not p.ignore_eos:
            return FinishReason.STOP, None
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH, None
        return None

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """End a sequence (also used for stop strings, aborts, errors) and free its blocks now."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq.table)
        seq.finish(reason, stop_reason)


def _fit(wants: list[int], room: int) -> list[int]:
    """Shares of `room` for these wants, none above its want, the largest cut first (water
    filling: every share is min(want, level), the level as high as the room allows)."""
    if sum(wants) <= room:
        return list(wants)
    level = 0
    while sum(min(w, level + 1) for w in wants) <= room:
        level += 1
    out = [min(w, level) for w in wants]
    spare = room - sum(out)
    for i, w in enumerate(wants):  # what the level leaves: one more each, in order
        if spare and w > level:
            out[i] += 1
            spare -= 1
    return out
