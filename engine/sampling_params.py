"""Per-request sampling settings (torch-free; the scheduler and server build these)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # a temperature under this samples greedily (vLLM's threshold)


@dataclass(frozen=True)
class StructuredOutputs:
    """The grammar a request's output must follow: exactly one of a JSON Schema (`json`, its
    text), any JSON object (`json_object`), a regular expression, a list of literal choices, or
    an EBNF grammar (`grammar`, xgrammar's EBNF / GBNF). The engine compiles it against the
    model's tokenizer (engine/structured.py) and masks every token choice with it: plain
    sampling, the draft tree's candidates and each verified node. Frozen and hashable: the
    compiled-grammar cache is keyed by it."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if self.choice is not None:
            _check(isinstance(self.choice, (list, tuple)) and len(self.choice) > 0
                   and all(isinstance(c, str) and c for c in self.choice),
                   f"structured choice must be a non-empty list of non-empty strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value.strip() != ""),
                   f"structured {name} must be a non-empty string, got {value!r}")
        _check(isinstance(self.json_object, bool), f"json_object must be a bool, got {self.json_object!r}")
        _check(len(self.kinds) == 1, "structured outputs take exactly one of json, json_object, regex, choice, "
               f"grammar; got {', '.join(self.kinds) or 'none'}")

    @property
    def kinds(self) -> list[str]:
        return [k for k in ("json", "json_object", "regex", "choice", "grammar")
                if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.kinds[0]


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature 0 means greedy, and so does any temperature below GREEDY_BELOW (as vLLM treats
    them): dividing the logits by 5e-324 made them infinite and picked token 0. `seed` keys the
    sampling noise together with the output position, so a seeded request draws the same tokens
    however it is batched, given the same logits (a bf16 batch can move them in their last bits).
    `stop` strings are matched by the output processor on text (none before `min_tokens` tokens);
    `stop_token_ids` by the engine on ids.
    `logprobs` = number of top alternatives to return per token (None: no logprobs at all).
    `max_tokens` None: up to the model's context (the engine resolves it when the request is
    added, as the server does for a chat request without max_tokens).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    structured: StructuredOutputs | None = None  # a grammar the output follows (None: free text)

    def __post_init__(self):
        _check(self.max_tokens is None or (_int(self.max_tokens) and self.max_tokens >= 1),
               f"max_tokens must be an integer >= 1 or None (up to the context), got {self.max_tokens!r}")
        _check(_finite(self.temperature) and self.temperature >= 0,
               f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_int(self.top_k) and (self.top_k >= 1 or self.top_k in (0, -1)),
               f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
        _check(_int(self.min_tokens) and 0 <= self.min_tokens
               and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
               f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        _check(isinstance(self.logit_bias, dict), f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
        for token, bias in self.logit_bias.items():
            _check(_int(token) and token >= 0, f"logit_bias key must be a token id, got {token!r}")
            _check(_finite(bias) and -100 <= bias <= 100, f"logit_bias values must be in [-100, 100], got {bias!r}")
        _check(self.logprobs is None or (_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        _check(self.seed is None or _int(self.seed), f"seed must be an integer, got {self.seed!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be a bool, got {getattr(self, name)!r}")
        # a lone string is one stop string (vLLM's `stop: str | list[str]`), not its characters
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        _check(isinstance(stop, (list, tuple)) and all(isinstance(x, str) and x for x in stop),
               f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        _check(isinstance(self.stop_token_ids, (list, tuple)) and all(_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        _check(self.structured is None or isinstance(self.structured, StructuredOutputs),
               f"structured must be a StructuredOutputs, got {self.structured!r}")
        # a grammar ends the text where it completes: min_tokens or ignore_eos would force tokens
        # past its end (every token masked)
        _check(self.structured is None or (self.min_tokens == 0 and not self.ignore_eos),
               "min_tokens and ignore_eos cannot be combined with structured output (the grammar decides "
               "where the output ends)")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
