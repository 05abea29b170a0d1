"""Detokenization, stop strings and per-request outputs (torch-free)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from eagle_serve.engine.step_io import TokenLogprobs
from eagle_serve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from eagle_serve.scheduler.sequence import FinishReason, Sequence, SpecStats


@dataclass
class RequestOutput:
    """A request's state after a step. `text_delta` is what this step added (for streaming)."""

    seq_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    text_delta: str
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[TokenLogprobs] | None
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    spec: SpecStats
    error: str | None = None
    # when the engine loop made it, right after its step (perf_counter, as the other times): the
    # server's inter-token latency reads it, not when a stream's reader got to it (a slow reader
    # pulls queued outputs in a burst)
    output_time: float = field(default_factory=time.perf_counter)


class SeqTextState:
    """Text of one sequence so far; holds back a possible stop-string prefix while streaming."""

    def __init__(self, tokenizer: Tokenizer, seq: Sequence):
        self.detok = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids)
        self.stops = seq.params.stop
        self.include_stop = seq.params.include_stop_str_in_output
        # as vLLM does: no stop string ends the output before min_tokens tokens (one that ends
        # within them is not matched later either); min_tokens already keeps EOS and stop ids out
        self.min_tokens = seq.params.min_tokens
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.num_ids = 0  # output ids consumed
        self.emitted = 0  # characters of `text` already handed out

    def update(self, seq: Sequence) -> tuple[str, str | None]:
        """Consume new output ids one at a time (a speculative burst may hold several); on a
        stop string, drop the ids after the one that completed it. Returns (delta, stop hit)."""
        hit = None
        while self.num_ids < len(seq.output_token_ids) and hit is None:
            start = len(self.text)  # a stop must end in what this id adds
            self.text += self.detok.add([seq.output_token_ids[self.num_ids]])
            self.num_ids += 1
            if seq.is_finished and self.num_ids == len(seq.output_token_ids):
                self.text += self.detok.flush()
            hit = self._find_stop(start) if self.num_ids >= self.min_tokens else None
        if hit is not None:
            del seq.output_token_ids[self.num_ids:]
            del seq.output_logprobs[self.num_ids:]
        end = len(self.text) if (seq.is_finished or hit) else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta, hit

    def _find_stop(self, new: int) -> str | None:
        """The first stop string that ends past text[new] (one that ended earlier, within
        min_tokens, stays unmatched: each stop is searched from its own length back)."""
        best = None
        for s in self.stops:
            i = self.text.find(s, max(0, new - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        return s


def make_output(seq: Sequence, state: SeqTextState | None, delta: str) -> RequestOutput:
    """`state` is None for an engine without a tokenizer: token ids only, no text."""
    reason = seq.finish_reason.value if isinstance(seq.finish_reason, FinishReason) else None
    return RequestOutput(
        seq_id=seq.seq_id, prompt_token_ids=seq.prompt_token_ids,
        token_ids=list(seq.output_token_ids), text=state.text if state else "", text_delta=delta,
        finished=seq.is_finished, finish_reason=reason, stop_reason=seq.stop_reason,
        logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
        arrival_time=seq.arrival_time, first_token_time=seq.first_token_time, finish_time=seq.finish_time,
        spec=SpecStats(seq.spec.verify_steps, seq.spec.draft_tokens, seq.spec.accepted_tokens,
                       list(seq.spec.accepted_per_depth)),
        error=seq.error)
