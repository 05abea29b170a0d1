"""The one generation loop: schedule -> engine step -> update -> outputs.

Every front door (the CLI, the offline `LLM`, the HTTP server through `AsyncEngine`) drives
this object. The engine is passed in as an `Executor` so this module never imports torch.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from typing import Protocol

from eagle_serve.engine.sampling_params import SamplingParams
from eagle_serve.engine.step_io import SeqResult, SeqStep
from eagle_serve.engine.tokenizer import Tokenizer
from eagle_serve.scheduler.block_allocator import BlockAllocator
from eagle_serve.scheduler.budget.interface import BudgetPolicy
from eagle_serve.scheduler.output_processor import RequestOutput, SeqTextState, make_output
from eagle_serve.scheduler.scheduler import Scheduler, SchedulerConfig
from eagle_serve.scheduler.sequence import FinishReason, Sequence


log = logging.getLogger("eagle_serve")


class Executor(Protocol):
    """What the loop needs from the engine."""

    def execute(self, steps: list[SeqStep]) -> list[SeqResult]: ...

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's engine-side state (e.g. pending draft features)."""

    @property
    def catchup_seconds(self) -> float:
        """Cumulative seconds of work that the tree budget must not learn as a round's cost (the
        drafter consuming a backlog of pending pairs); 0.0 for an engine without a drafter."""

    @property
    def catchup_pairs(self) -> int:
        """Cumulative pending pairs that work consumed."""


class IdleWork(Protocol):
    """Engine work to run while no sequence is running (the tree budget's cost profile, taken
    again after a contended one)."""

    def idle_due_in(self) -> float | None:
        """Seconds until the work is due (<= 0: now); None: no work."""

    def run_idle(self) -> None:
        """Do the work (engine thread, no sequence running)."""


class PromptTooLong(ValueError):
    pass


@dataclasses.dataclass
class _SeqError(Exception):
    seq_id: int
    error: BaseException


class EngineLoop:
    def __init__(self, executor: Executor, tokenizer: Tokenizer | None, allocator: BlockAllocator,
                 config: SchedulerConfig, eos_token_ids: frozenset[int], vocab_size: int,
                 spec_tokens: int = 1, spec_slots: int = 0, budget: BudgetPolicy | None = None,
                 idle_work: IdleWork | None = None,
                 tree_tokens: int | None = None):
        self.executor = executor
        self.idle_work = idle_work
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(config, allocator, eos_token_ids, spec_tokens, spec_slots, budget, tree_tokens)
        self.num_steps = 0
        self.last_step_time: float | None = None
        self._round_start: float | None = None
        self._catchup_start = 0.0
        self._catchup_pairs_start = 0
        self.vocab_size = vocab_size
        self._ids = itertools.count()
        self._text: dict[int, SeqTextState] = {}
        self._seqs: dict[int, Sequence] = {}

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        self._validate(prompt_token_ids, params)
        if params.max_tokens is None:  # up to the context
            params = dataclasses.replace(params, max_tokens=self.scheduler.config.max_model_len - len(prompt_token_ids))
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        seq = Sequence(next(self._ids), list(prompt_token_ids), params, seed,
                       self.scheduler.allocator.new_table())
        self._text[seq.seq_id] = SeqTextState(self.tokenizer, seq) if self.tokenizer else None
        self._seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise what add_request would raise for this request, adding nothing (a request of
        several sequences checks them all before it adds one)."""
        self._validate(prompt, params)

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        max_len = self.scheduler.config.max_model_len
        if not prompt:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size)]
        if bad:
            what = "is not an integer token id" if not isinstance(bad[0], int) or isinstance(bad[0], bool) else \
                f"is outside the vocabulary [0, {self.vocab_size})"
            raise ValueError(f"prompt token id {bad[0]!r} {what}")
        if params.max_tokens is None and len(prompt) >= max_len:
            raise PromptTooLong(
                f"this model's maximum context length is {max_len} tokens; the prompt has {len(prompt)} "
                f"tokens, which leaves none to generate")
        if params.max_tokens is None and params.min_tokens > max_len - len(prompt):
            raise ValueError(f"min_tokens is {params.min_tokens} but the context leaves "
                             f"{max_len - len(prompt)} tokens after the prompt")
        if params.max_tokens is not None and len(prompt) + params.max_tokens > max_len:
            raise PromptTooLong(
                f"this model's maximum context length is {max_len} tokens; the prompt has "
                f"{len(prompt)} tokens and max_tokens is {params.max_tokens} "
                f"({len(prompt) + params.max_tokens} in total)")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (this engine was built with skip_tokenizer)")
        if any(t < 0 or t >= self.vocab_size for t in params.logit_bias):
            raise ValueError(f"logit_bias has a token id outside the vocabulary [0, {self.vocab_size})")

    def idle_due_in(self) -> float | None:
        return None if self.idle_work is None else self.idle_work.idle_due_in()

    def idle_due(self) -> bool:
        due = self.idle_due_in()
        return due is not None and due <= 0 and not self.has_unfinished

    def run_idle(self) -> None:
        """The idle work (on the engine thread); nothing if a sequence arrived meanwhile. Idle
        work that raises is logged, never passed on: it must not fail a request or the loop."""
        if self.idle_work is not None and not self.has_unfinished:
            try:
                self.idle_work.run_idle()
            except Exception as e:  # noqa: BLE001
                log.warning("idle work failed: %r", e)

    def has_request(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def abort(self, seq_id: int, reason: FinishReason = FinishReason.ABORT,
              error: str | None = None) -> RequestOutput | None:
        """End a request now (its blocks are freed); returns its final output, None if unknown."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return None
        seq.error = error
        self.scheduler.finish(seq, reason)
        self.executor.release(seq_id)
        return make_output(seq, self._text.pop(seq_id, None), "")

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an output for every sequence that changed."""
        seqs, steps = self.plan()
        if not seqs:
            return []
        return self.complete(seqs, self.execute(seqs, steps))

    def plan(self) -> tuple[list[Sequence], list[SeqStep]]:
        """Schedule the next step (admission, block reservations, tree budgets)."""
        self._round_start = time.perf_counter()
        self._catchup_start = self.executor.catchup_seconds
        self._catchup_pairs_start = self.executor.catchup_pairs
        seqs = self.scheduler.schedule()
        return seqs, self.scheduler.steps(seqs)

    def execute(self, seqs: list[Sequence], steps: list[SeqStep]) -> list[SeqResult | BaseException]:
        """The engine step (the only part that runs the model; the async engine runs it in a
        worker thread). If the batch raises, each sequence is retried alone with fresh engine
        state, so an error fails only the sequence that causes it."""
        try:
            return self.executor.execute(steps)
        except Exception as batch_error:  # noqa: BLE001 - isolate, then report per sequence
            if len(steps) == 1:
                return [batch_error]
            out: list[SeqResult | BaseException] = []
            for step in steps:
                self.executor.release(step.seq_id)
                try:
                    out.extend(self.executor.execute([dataclasses.replace(step, restart=True)]))
                except Exception as e:  # noqa: BLE001
                    out.append(_SeqError(step.seq_id, e))
            return out

    def complete(self, seqs: list[Sequence], results: list) -> list[RequestOutput]:
        """Apply a step's results: commit KV, append tokens, detokenize, finish what is done."""
        now = time.perf_counter()
        ok, failed = [], {}
        if len(results) == 1 and isinstance(results[0], BaseException) and not isinstance(results[0], _SeqError):
            failed = {seqs[0].seq_id: results[0]}
            results = []
        for r in results:
            if isinstance(r, _SeqError):
                failed[r.seq_id] = r.error
            else:
                ok.append(r)
        good = [s for s in seqs if s.seq_id not in failed]
        bad = [s for s in seqs if s.seq_id in failed]
        self.scheduler.fail(bad)
        for seq in bad:
            seq.error = f"{type(failed[seq.seq_id]).__name__}: {failed[seq.seq_id]}"
            self.scheduler.finish(seq, FinishReason.ERROR)
        sampled = {r.seq_id for r in ok}
        for seq in good:
            if seq.seq_id in sampled:
                seq.first_token_time = seq.first_token_time or now
        # the round as the tree budget models it: tokens in the forward, sequences drafting each level
        forward_tokens = sum(s.num_scheduled for s in seqs) + sum(r.num_draft_tokens for r in ok)
        prefill = any(s.num_scheduled > 1 for s in seqs)  # a prompt chunk (decoding sequences schedule 1)
        levels = [0] * max((r.draft_depth for r in ok if r.num_draft_tokens), default=0)
        for r in ok:
            if r.num_draft_tokens:
                for lv in range(r.draft_depth):
                    levels[lv] += 1
        self.scheduler.update(good, ok)
        self.num_steps += 1
        self.last_step_time = now
        outputs = [self._output(seq) for seq in seqs if seq.seq_id in sampled or seq.is_finished]
        budget = self.scheduler.budget
        if budget is not None and not failed and self._round_start is not None:
            # wall time of the whole round: plan, engine step (with its thread hop), outputs; a
            # drafter's backlog catch-up is left out of what the cost model learns
            seconds = time.perf_counter() - self._round_start
            catchup = self.executor.catchup_seconds - self._catchup_start
            pairs = self.executor.catchup_pairs - self._catchup_pairs_start
            budget.observe_round(forward_tokens, levels, seconds, committed=sum(len(r.token_ids) for r in ok),
                                 catchup=max(catchup, 0.0), prefill=prefill, catchup_pairs=max(pairs, 0))
        elif budget is not None:
            budget.skip_round()
        self._round_start = None
        return outputs

    def _output(self, seq: Sequence) -> RequestOutput:
        state = self._text[seq.seq_id]
        delta = ""
        if state is not None:
            delta, hit = state.update(seq)
            if hit is not None and seq.is_finished:  # a burst ended it later; the stop came first
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, hit
            elif hit is not None:
                self.scheduler.finish(seq, FinishReason.STOP, hit)
        if seq.is_finished:
            self.executor.release(seq.seq_id)
            self._seqs.pop(seq.seq_id, None)
            self._text.pop(seq.seq_id, None)
        return make_output(seq, state, delta)

    def run_to_completion(self, seq_ids: set[int] | None = None, cancel=None) -> dict[int, RequestOutput]:
        """Step until every request (or those of seq_ids) has finished; their final outputs.
        `cancel` (a threading.Event): checked before each step, KeyboardInterrupt once set."""
        final: dict[int, RequestOutput] = {}
        while self.has_unfinished and (seq_ids is None or not seq_ids <= final.keys()):
            if cancel is not None and cancel.is_set():
                raise KeyboardInterrupt("interrupted")
            for out in self.step():
                if out.finished:
                    final[out.seq_id] = out
        return final
