"""What the scheduler hands the engine for one step, and what comes back (torch-free).

The scheduler speaks in ints and lists; the engine turns a list of `SeqStep` into one packed
forward and returns one `SeqResult` per step that asked for a sample.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from eagle_serve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SeqStep:
    """One sequence's share of a forward.

    The new tokens sit at storage positions [num_cached, num_cached + len(token_ids)); the
    block table already has room for them. `output_token_ids` are the tokens generated so far
    (penalties count them; the next sample is output position len(output_token_ids)).
    """

    seq_id: int
    token_ids: list[int]
    num_cached: int
    block_table: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int]
    sample: bool = True  # False for a prefill chunk that does not reach the prompt's end
    max_new_tokens: int = 1  # most tokens this step may emit (bounds the draft depth)
    prompt_token_ids: list[int] = field(default_factory=list)  # shared, not copied (n-gram lookup)
    tree_tokens: int | None = None  # most tokens to verify this round, root included; None: the configured tree
    tree_depth: int | None = None  # most levels to draft this round; None: tree_tokens - 1 (or the configured depth)
    restart: bool = True  # the sequence's first step since admission: engine-side state starts over
    head_sync: bool = True  # not drafting this round: may the drafter still consume its backlog (sync)

    @property
    def history(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def feeds_prompt(self) -> bool:
        """Its new tokens are a prompt's (a chunk, or the one token a prefix-cache hit left), not
        its last output token alone: no tree, and the kernels its whole prompt would take
        (ForwardBatch.prompt_lens; the scheduler's side of it is Sequence.decodes_next)."""
        return len(self.token_ids) > 1 or not self.output_token_ids

    @property
    def output_position(self) -> int:
        return len(self.output_token_ids)


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probability of the chosen token and of the top alternatives (target model, raw)."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class SeqResult:
    """What one step produced for a sequence: the accepted draft tokens then one token from the
    target (the bonus), in order; exactly one token for a plain step."""

    seq_id: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # one per token when requested
    num_draft_tokens: int = 0  # tokens the target verified besides the root (0: plain step)
    accepted_per_depth: tuple[int, ...] = ()  # 1 per accepted depth, for stats
    # the draft's confidence in this round's tree: estimated probability that the target accepts
    # each drafted node's whole path, best first (EAGLE: exp of the cumulative draft log-prob)
    draft_confidence: tuple[float, ...] = ()
    draft_depths: tuple[int, ...] = ()  # each confidence's node depth
    draft_depth: int = 0  # levels drafted this round (the draft's cost)
    head_backlog: int = 0  # pairs the drafter holds for the sequence, still unconsumed after this round

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1
