"""One request's state: tokens, sampling settings, KV blocks, status, timing."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.engine.step_io import SeqResult, TokenLogprobs
from eagle_serve.scheduler.block_allocator import BlockTable


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"
    ERROR = "error"


@dataclass
class SpecStats:
    """Speculation counters of one sequence (verify steps only; plain steps are not counted)."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_depth: list[int] = field(default_factory=list)

    def add(self, result: SeqResult) -> None:
        if result.num_draft_tokens == 0:
            return
        self.verify_steps += 1
        self.draft_tokens += result.num_draft_tokens
        self.accepted_tokens += result.num_accepted
        for depth, n in enumerate(result.accepted_per_depth):
            if depth >= len(self.accepted_per_depth):
                self.accepted_per_depth.append(0)
            self.accepted_per_depth[depth] += n


@dataclass(eq=False)
class Sequence:
    """Invariant while running: KV is committed for all tokens but the last one, which is the
    input of the next step (`num_tokens - 1 == table.num_committed` after each step)."""

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    table: BlockTable
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    # per step, set by the scheduler
    num_scheduled: int = 0  # tokens fed this step (a prefill chunk, or the one new token)
    decoding: bool = False  # `decodes_next` when this step was planned (metrics read it after the step)
    tree_tokens: int | None = None  # tokens the step may verify (1: no speculation; None: the engine's tree)
    tree_depth: int | None = None  # levels the step may draft (None: the engine's rule)
    restart: bool = True  # first step since admission: engine-side state starts over
    head_sync: bool = True  # not drafting this step: the drafter may still consume its backlog
    head_backlog: int = 0  # pairs the drafter held for it after its last sampled step
    error: str | None = None  # why an engine error ended it (finish reason ERROR)
    _hashes: list[bytes] = field(default_factory=list)  # block_allocator.BlockHash

    def block_hashes(self, block_size: int, num_tokens: int | None = None) -> list[bytes]:
        """Prefix-cache hashes of the full blocks among the first `num_tokens` tokens."""
        from eagle_serve.scheduler.block_allocator import block_hashes
        n = (self.num_tokens if num_tokens is None else num_tokens) // block_size
        if len(self._hashes) < n:
            start = len(self._hashes)
            tokens = self.token_ids(start * block_size, n * block_size)
            self._hashes.extend(block_hashes(tokens, block_size, self._hashes[-1] if self._hashes else None))
        return self._hashes[:n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose KV is not in the cache yet (the next step's inputs)."""
        return self.num_tokens - self.table.num_committed

    @property
    def decodes_next(self) -> bool:
        """Its next step feeds its last output token alone, which may carry a tree. Not a prompt's
        last token (a one-token chunk, or what a prefix-cache hit left): that is computed as a
        prompt, whose rounding must be its whole prompt's (ForwardBatch.prompt_lens)."""
        return self.num_uncomputed == 1 and self.table.num_committed > 0 and bool(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids(self, start: int, stop: int) -> list[int]:
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n_prompt]

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = time.perf_counter()
