"""Prometheus metrics (one registry per server). Every label value exists from start-up, so all
series are there before the first request. Count histograms (acceptance length, tree tokens)
use count buckets, latency histograms use seconds."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

COUNT_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                   40.0, 80.0)
# a request's whole time and its time to first token (queueing included) run to minutes: a chat
# without max_tokens may generate up to the context, and under load waits behind others
LONG_LATENCY_BUCKETS = LATENCY_BUCKETS + (120.0, 240.0, 480.0, 960.0, 1920.0, 3600.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
FINISH_REASONS = ("stop", "length", "abort", "error")
MAX_DEPTH_LABELS = 16
COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_named", "tool_required")
TOOL_READERS = ("named", "required", "hermes", "llama3_json")


class _Totals:
    """Counters the engine keeps itself (read at scrape time): preemptions and prefix-cache
    lookups, in tokens (vLLM's prefix_cache_queries / prefix_cache_hits)."""

    def __init__(self, totals):
        self.totals = totals

    def collect(self):
        t = self.totals()
        for name, doc in (("num_preemptions", "Sequences preempted (their KV freed, recomputed later)"),
                          ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
                          ("prefix_cache_hits", "Of those, tokens found (KV reused, not recomputed)")):
            yield CounterMetricFamily("eagle_serve_" + name, doc, value=t[name])


class Metrics:
    def __init__(self, running, waiting, kv_usage, max_depth: int, totals=None):
        """running / waiting / kv_usage: gauges' readers; totals(): {num_preemptions,
        prefix_cache_queries, prefix_cache_hits}, the engine's own running counts."""
        r = self.registry = CollectorRegistry()
        p = "eagle_serve_"
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of admitted requests (a prompt shared by "
                                     "n choices once, as usage counts it)", registry=r)
        # counted as each step commits them (after stop strings), so a long stream shows in the
        # rate while it runs, not as one jump at its end
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self._counted: dict[int, int] = {}  # seq_id -> its tokens counted so far (unfinished sequences)
        self.decode_steps = Counter(p + "decode_steps", "Engine steps that decoded (a step that only prefills, or "
                                    "samples a prompt's first token, is not one), by mode", ["mode"], registry=r)
        # at which loads the engine drafts: the tree budget's choice is per batch size
        self.decode_batch = Histogram(p + "decode_batch_size", "Sequences that decoded in an engine step, by mode",
                                      ["mode"], buckets=BATCH_BUCKETS, registry=r)
        self.verify_steps = Counter(p + "spec_verify_steps", "Per-sequence rounds that verified a draft", registry=r)
        self.draft_tokens = Counter(p + "spec_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted_tokens = Counter(p + "spec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_depth = Counter(p + "spec_accepted_tokens_per_depth", "Draft tokens accepted at each depth",
                                          ["depth"], registry=r)
        self.acceptance_length = Histogram(p + "spec_acceptance_length", "Tokens a verify step gave (accepted draft "
                                           "tokens + 1), before a finish inside the round drops any",
                                           buckets=COUNT_BUCKETS, registry=r)
        self.tree_tokens = Histogram(p + "spec_tree_tokens", "Tokens verified per sequence per round (root included)",
                                     buckets=COUNT_BUCKETS, registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time to first token", buckets=LONG_LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between output tokens", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.latency = Histogram(p + "request_latency_seconds", "Arrival to finish", buckets=LONG_LATENCY_BUCKETS,
                                 registry=r)
        self.requests = Counter(p + "requests", "Finished requests, by finish reason (each of n choices counts as "
                                "one)", ["finish_reason"], registry=r)
        # structured output and tool calls (server/structured.py, server/tool_parsers.py)
        self.structured_requests = Counter(p + "structured_output_requests", "Requests whose output follows a "
                                           "grammar, by what asked for it", ["kind"], registry=r)
        self.grammar_compile_seconds = Histogram(p + "grammar_compile_seconds", "Time to compile a request's "
                                                 "grammar (cache misses)", buckets=COMPILE_BUCKETS, registry=r)
        self.grammar_cache_hits = Counter(p + "grammar_cache_hits", "Request grammars found compiled in the cache",
                                          registry=r)
        self.tool_calls = Counter(p + "tool_calls_parsed", "Tool calls read from answers, by reader", ["parser"],
                                  registry=r)
        self.tool_call_failures = Counter(p + "tool_call_parse_failures", "Answers or tool-call blocks that did "
                                          "not parse as calls (left as content), by reader", ["parser"], registry=r)
        for kind in STRUCTURED_KINDS:
            self.structured_requests.labels(kind)
        for parser in TOOL_READERS:
            self.tool_calls.labels(parser)
            self.tool_call_failures.labels(parser)
        if totals is not None:
            r.register(_Totals(totals))
        Gauge(p + "requests_running", "Sequences running", registry=r).set_function(running)
        Gauge(p + "requests_waiting", "Sequences waiting", registry=r).set_function(waiting)
        Gauge(p + "kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r).set_function(kv_usage)
        for mode in ("spec", "plain"):
            self.decode_steps.labels(mode)
            self.decode_batch.labels(mode)
        for reason in FINISH_REASONS:
            self.requests.labels(reason)
        for d in range(1, min(max_depth, MAX_DEPTH_LABELS) + 1):
            self.accepted_per_depth.labels(str(d))

    def on_step(self, seqs, results, outputs, seconds: float) -> None:
        decoding = {s.seq_id for s in seqs if s.decoding}
        ok = [r for r in results if not isinstance(r, BaseException)]
        decoded = [r for r in ok if r.token_ids and r.seq_id in decoding]
        for out in outputs:
            if not out.finished:  # (a finished one is counted by on_finish, which runs first)
                n = len(out.token_ids)
                self.generation_tokens.inc(n - self._counted.get(out.seq_id, 0))
                self._counted[out.seq_id] = n
        if decoded:
            spec = any(r.num_draft_tokens for r in decoded)
            mode = "spec" if spec else "plain"
            self.decode_steps.labels(mode).inc()
            self.decode_batch.labels(mode).observe(len(decoded))
        for r in decoded:
            if r.num_draft_tokens:
                self.verify_steps.inc()
                self.draft_tokens.inc(r.num_draft_tokens)
                self.accepted_tokens.inc(r.num_accepted)
                self.acceptance_length.observe(len(r.token_ids))
                for d, n in enumerate(r.accepted_per_depth, 1):
                    if n and d <= MAX_DEPTH_LABELS:
                        self.accepted_per_depth.labels(str(d)).inc(n)
            self.tree_tokens.observe(r.num_draft_tokens + 1)

    def on_finish(self, out) -> None:
        self.requests.labels(out.finish_reason or "abort").inc()
        self.generation_tokens.inc(len(out.token_ids) - self._counted.pop(out.seq_id, 0))
        if out.finish_time is not None:
            self.latency.observe(out.finish_time - out.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LatencyTracker:
    """One request's time to first token and inter-token latencies, observed as its outputs are
    read; the times are the engine's (each output's own), not the reader's."""

    def __init__(self, metrics: Metrics):
        self.m = metrics
        self.last: dict[int, float] = {}
        self.count: dict[int, int] = {}

    def see(self, out) -> None:
        now = out.output_time
        n_new = len(out.token_ids) - self.count.get(out.seq_id, 0)
        if n_new > 0:
            if out.seq_id not in self.last and out.first_token_time is not None:
                self.m.ttft.observe(out.first_token_time - out.arrival_time)
                n_new -= 1
            elif out.seq_id in self.last:
                gap = (now - self.last[out.seq_id]) / n_new
                for _ in range(n_new):
                    self.m.itl.observe(gap)
            self.last[out.seq_id] = now
            self.count[out.seq_id] = len(out.token_ids)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {series (name with labels): value} (tests, bench/)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
