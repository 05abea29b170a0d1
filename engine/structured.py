"""Grammar masks for structured output: compiled grammars (xgrammar) and one matcher per sequence.

`Grammars` compiles a request's `StructuredOutputs` against the model's tokenizer, checks it
first (size, nesting, JSON Schema validity, keywords the compiler would silently drop) and keeps a
bounded cache of compiled grammars keyed by the spec. `GrammarState` follows one sequence: it
accepts the output tokens as they are committed and gives the allowed-token bitmask at the
sequence's next position, at every node of a draft tree (each node's mask follows its own path
from the root), and the candidates of a draft that the grammar allows.

The masks only remove tokens: with them applied before the target picks, tree acceptance picks
exactly what plain decoding under the same grammar picks (engine/speculative/accept.py).
"""
from __future__ import annotations

import collections
import json
import threading
import time
from dataclasses import dataclass

import torch

from eagle_serve.engine.sampling_params import StructuredOutputs

MAX_SPEC_CHARS = 65_536  # a schema, regex, grammar or the choices together, as text
MAX_SCHEMA_DEPTH = 32  # nesting of a JSON Schema's objects and arrays
MAX_CHOICES = 1024
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)
MAX_WHITESPACE = 16  # a newline and indentation seven levels deep at two spaces

# JSON Schema keywords the compiler accepts and does not enforce: a schema using them is refused,
# never served with an output that may not validate
UNSUPPORTED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
                        "contains", "minContains", "maxContains", "uniqueItems", "patternProperties",
                        "unevaluatedProperties", "unevaluatedItems", "propertyNames")


class GrammarError(ValueError):
    """A structured-output spec that cannot be served; `field` names what is wrong."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass
class GrammarStats:
    """Counters the server exports (compile seconds each, cache hits, misses, failures)."""

    hits: int = 0
    misses: int = 0
    failures: int = 0
    compile_seconds: collections.deque = None

    def __post_init__(self):
        self.compile_seconds = collections.deque(maxlen=4096)


def _xgr():
    import xgrammar
    return xgrammar


def tokenizer_info(tokenizer, vocab_size: int, stop_ids) -> "xgrammar.TokenizerInfo":  # noqa: F821
    """xgrammar's view of the tokenizer: the vocabulary (as the tokenizers library holds it),
    its kind (byte-level, byte fallback, raw) detected from the tokenizer file, the model's
    vocabulary size (the logits' width, which may exceed the tokenizer's) and its stop ids."""
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    return _xgr().TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids))


class Grammars:
    """Compiles structured-output specs for one model; thread-safe (the server compiles off the
    engine loop, in a worker thread, and the engine looks the result up)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids, cache_size: int = CACHE_SIZE):
        xgr = _xgr()
        self.info = tokenizer_info(tokenizer, vocab_size, stop_ids)
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.cache: collections.OrderedDict[StructuredOutputs, object] = collections.OrderedDict()
        self.cache_size = cache_size
        self.stats = GrammarStats()
        self._lock = threading.Lock()

    def cached(self, spec: StructuredOutputs) -> bool:
        with self._lock:
            return spec in self.cache

    def get(self, spec: StructuredOutputs):
        """The compiled grammar for `spec` (compiling it on a miss); GrammarError if it cannot be."""
        with self._lock:
            hit = self.cache.get(spec)
            if hit is not None:
                self.cache.move_to_end(spec)
                self.stats.hits += 1
        if hit is not None:
            return hit
        check(spec)
        t0 = time.perf_counter()
        try:
            compiled = self._compile(spec)
        except GrammarError:
            self.stats.failures += 1
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError with the parser's message
            self.stats.failures += 1
            raise GrammarError(f"{_field(spec)} does not compile: {_message(e)}", _field(spec)) from None
        seconds = time.perf_counter() - t0
        with self._lock:
            self.stats.misses += 1
            self.stats.compile_seconds.append(seconds)
            self.cache[spec] = compiled
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputs):
        c = self.compiler
        if spec.json is not None:
            # whitespace between tokens, as JSON allows, up to MAX_WHITESPACE characters a gap: pretty
            # printing fits, a model stuck in newlines (small ones are) does not run to max_tokens
            return c.compile_json_schema(spec.json, any_whitespace=True, strict_mode=True,
                                         max_whitespace_cnt=MAX_WHITESPACE)
        if spec.json_object:
            return c.compile_builtin_json_grammar()
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:
            return c.compile_grammar(_choice_ebnf(spec.choice))
        return c.compile_grammar(spec.grammar)

    def state(self, spec: StructuredOutputs) -> "GrammarState":
        return GrammarState(self.get(spec), self.vocab_size)


class GrammarState:
    """One sequence's matcher: the grammar's state after the output tokens accepted so far."""

    def __init__(self, compiled, vocab_size: int):
        xgr = _xgr()
        self.matcher = xgr.GrammarMatcher(compiled)  # rollback is unbounded
        self.vocab_size = vocab_size
        self.num_accepted = 0
        self._one = xgr.allocate_token_bitmask(1, vocab_size)

    @property
    def words(self) -> int:
        return self._one.shape[1]

    def accept(self, tokens: list[int]) -> None:
        """Advance by committed output tokens; a token the grammar refuses is an engine fault."""
        for t in tokens:
            if self.matcher.is_terminated():
                raise RuntimeError(f"token {t} follows the end of the structured output")
            if not self.matcher.accept_token(t):
                raise RuntimeError(f"token {t} is not allowed by the request's grammar here")
            self.num_accepted += 1

    def sync(self, output_token_ids: list[int]) -> None:
        """Accept the outputs committed since the last call."""
        self.accept(output_token_ids[self.num_accepted:])

    def allows(self, token: int) -> bool:
        """Whether the grammar allows `token` next (the state is left as it was)."""
        m = self.matcher
        if m.is_terminated() or not m.accept_token(token):
            return False
        m.rollback(1)
        return True

    def tree_masks(self, tokens: list[int], parents: list[int], out: torch.Tensor) -> None:
        """out[i] = the allowed-token bitmask after node i's path (node 0 the root, already
        accepted; nodes in topological order). A node whose own token the grammar refuses has
        an all-zero mask (it cannot be accepted: its parent's mask excludes it)."""
        m = self.matcher
        children: list[list[int]] = [[] for _ in tokens]
        for i in range(1, len(tokens)):
            children[parents[i]].append(i)
        out.zero_()
        stack = [(0, False)]  # (node, leaving): depth first, rolling back on the way out
        while stack:
            node, leaving = stack.pop()
            if leaving:
                m.rollback(1)
                continue
            if node and (m.is_terminated() or not m.accept_token(tokens[node])):
                continue
            if node:
                stack.append((node, True))
            self._fill(out, node)
            stack.extend((c, False) for c in reversed(children[node]))

    def _fill(self, out: torch.Tensor, row: int) -> None:
        if self.matcher.is_terminated():
            return  # nothing may follow (the row stays all zero)
        self.matcher.fill_next_token_bitmask(out, row)

    def valid_candidates(self, tokens: list[int], parents: list[int]) -> list[bool]:
        """Which draft candidates the grammar allows along their path from the root (parents: -1
        = the root; a parent comes before its children)."""
        m = self.matcher
        children: dict[int, list[int]] = collections.defaultdict(list)
        for i, p in enumerate(parents):
            children[p].append(i)
        ok = [False] * len(tokens)
        stack = [(c, False) for c in reversed(children[-1])]
        while stack:
            c, leaving = stack.pop()
            if leaving:
                m.rollback(1)
                continue
            if m.is_terminated() or not m.accept_token(tokens[c]):
                continue
            ok[c] = True
            stack.append((c, True))
            stack.extend((k, False) for k in reversed(children[c]))
        return ok


def allocate(rows: int, vocab_size: int) -> torch.Tensor:
    return _xgr().allocate_token_bitmask(rows, vocab_size)


def check(spec: StructuredOutputs) -> None:
    """Refuse, naming the field, what the engine will not compile: too large, too deep, an invalid
    JSON Schema, or keywords the compiler does not enforce."""
    field = _field(spec)
    size = sum(len(c) for c in spec.choice) if spec.choice is not None else len(spec.json or spec.regex or spec.grammar or "")
    if size > MAX_SPEC_CHARS:
        raise GrammarError(f"{field} is {size} characters long; at most {MAX_SPEC_CHARS} are served", field)
    if spec.choice is not None and len(spec.choice) > MAX_CHOICES:
        raise GrammarError(f"{field} has {len(spec.choice)} choices; at most {MAX_CHOICES} are served", field)
    if spec.json is None:
        return
    try:
        schema = json.loads(spec.json)
    except ValueError as e:
        raise GrammarError(f"{field} is not valid JSON: {e}", field) from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{field} must be a JSON object (a JSON Schema), got {type(schema).__name__}", field)
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"{field} nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are served", field)
    import jsonschema
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise GrammarError(f"{field} is not a valid JSON Schema{' at ' + where if where else ''}: {e.message}",
                           field) from None
    bad = sorted(_keywords(schema) & set(UNSUPPORTED_KEYWORDS))
    if bad:
        raise GrammarError(f"{field} uses JSON Schema keywords structured output does not enforce: "
                           f"{', '.join(bad)}", field)


def _keywords(schema) -> set[str]:
    """Keywords used anywhere in a schema (property names under `properties` / `$defs` are names,
    not keywords)."""
    found: set[str] = set()
    stack = [(schema, False)]
    while stack:
        node, names = stack.pop()
        if isinstance(node, dict):
            if not names:
                found.update(node)
            for k, v in node.items():
                stack.append((v, not names and k in ("properties", "$defs", "definitions", "dependentSchemas")))
        elif isinstance(node, list):
            stack.extend((v, False) for v in node)
    return found


def _depth(node, level: int = 0) -> int:
    if isinstance(node, dict):
        return max((_depth(v, level + 1) for v in node.values()), default=level + 1)
    if isinstance(node, list):
        return max((_depth(v, level + 1) for v in node), default=level + 1)
    return level


def _choice_ebnf(choices: tuple[str, ...]) -> str:
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _field(spec: StructuredOutputs) -> str:
    return {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}[spec.kind]


def _message(e: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(e).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1] if "/" in text.split(": ", 1)[0] else text
    return text.splitlines()[0] if text else type(e).__name__
