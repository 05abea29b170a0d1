"""EAGLE drafting: the head consumes the accepted tokens with their true target features, then
grows a tree one batched forward per depth (EAGLE-2 dynamic, or an EAGLE-1 static shape).

Draft KV: pair j = (token x_{j+1}, target feature f_j) lives at storage position j of the
sequence's blocks (the target's block table, a separate one-layer cache). Pairs built from
predicted features (the tree phase) go to scratch positions past the committed pairs and are
overwritten next round: the rollback costs nothing.

Pending pairs (observed, still unconsumed by a head forward) keep their target features in a
feature cache paged like the KV cache: row `slot(j)` of one [slots, width] tensor holds the
feature of position j. A round's observed rows go in with one index_copy, whatever the batch:
per-round copies per sequence would pile up thousands of small live tensors under load, and the
garbage collector and allocator would slow every round (docs/architecture.md).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from eagle_serve.engine import hugepages, quant
from eagle_serve.engine.attention import make_backend
from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch, take_rows
from eagle_serve.engine.kv_cache import KVCache
from eagle_serve.engine.layers import RotaryEmbedding
from eagle_serve.engine.models.llama import LlamaForCausalLM
from eagle_serve.engine.speculative.config import SpecConfig
from eagle_serve.engine.speculative.drafters import Drafter
from eagle_serve.engine.speculative.eagle_head import _NONE, EagleHead, shares_target_rotary
from eagle_serve.engine.speculative.tree import Candidates, DraftTree, build_tree, root_only, select_best
from eagle_serve.engine.step_io import SeqStep


MAX_CONFIDENCE = 64  # node confidences reported per round (the budget's largest tree)
SYNC_BACKLOG = 128  # pending pairs at which a sequence that is not drafting catches up
IDLE_ROUNDS = 64  # rounds without any draft after which catch-ups wait for the next draft
MAX_BACKLOG = 1024  # pending pairs at which a sequence catches up regardless (bounds a catch-up's forward)
CATCHUP_SPLIT = 16  # a drafting sequence with more pending pairs consumes them in a forward of their own
CATCHUP_CHUNKED_MAX = 64  # catch-ups of up to this many pairs run in native-stack chunks (_catchup_chunk)


@dataclass
class HeadState:
    draft_len: int = 0  # committed pairs in the draft cache
    tokens: list[int] = field(default_factory=list)  # pending pairs (positions draft_len, ...), still unconsumed


@dataclass
class Growth:
    """One sequence's tree while it grows."""

    cands: Candidates
    depths: list[int]
    frontier: list[int]  # candidate indices to expand next
    frontier_feats: torch.Tensor  # [len(frontier), h] input feature of each frontier node
    scratch: list[int] = field(default_factory=list)  # candidates whose pair sits in scratch
    max_depth: int = 1
    static_paths: dict[int, tuple[int, ...]] = field(default_factory=dict)  # eagle1: cand -> rank path


class EagleDrafter(Drafter):
    needs_features = True
    filters_candidates = True  # _tree picks among the candidates `allowed` keeps

    def __init__(self, head: EagleHead, target: LlamaForCausalLM, spec: SpecConfig, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device, attention: str = "auto"):
        cfg = head.config
        self.head, self.target, self.spec = head, target, spec
        self.block_size, self.device = block_size, device
        self.kv = KVCache(1, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)
        # the pending pairs' target features, by KV slot ([f ; aux] for a fused-feature head);
        # zeroed here, as the KV caches are, so no slot's first write faults its pages in during
        # serving
        self.features = hugepages.zeros((num_blocks * block_size,
                                         feature_width(target.config.hidden_size, head.aux_layers)), dtype, device)
        self.backend = make_backend(cfg.head_dim ** -0.5, device, dtype, attention)
        # an EAGLE-3 head brings its own RoPE where it differs from the target's, and its own
        # token embedding where it has one (Eagle3Head.rotary / embed_tokens)
        self.rotary = head.rotary if head.rotary is not None else (
            target.model.rotary if shares_target_rotary(cfg, target.config) else _rotary(cfg))
        self.embed = head.embed_tokens if head.embed_tokens is not None else target.model.embed_tokens
        if quant.is_quantized(self.embed):  # the native draft paths read a dense table (vocab x hidden at dtype)
            self.embed = nn.Embedding.from_pretrained(quant.dense_weight(self.embed), freeze=True)
        # per KV slot: 1 once the head's KV there was written from the slot's current feature and
        # the pair that follows it (a consumed pair), 0 from the feature's write until then. A
        # sequence that hits the prefix cache reads it to know how much of the shared prefix's
        # head KV it can reuse (`_reset`)
        self.head_written = bytearray(num_blocks * block_size)
        self.states: dict[int, HeadState] = {}
        self._confidence: dict[int, tuple[tuple[float, ...], tuple[int, ...]]] = {}  # seq -> last tree's (confidences, depths)
        self.static = spec.method == "eagle1"
        # static: child ranks under every rank path (() = the root); width = ranks the LM head must rank
        self._children = _static_children(spec.static_tree) if self.static else {}
        self.width = 1 + max(max(p) for p in spec.static_tree) if self.static else spec.top_k
        vocab = len(head.d2t) if head.d2t is not None else target.config.vocab_size
        if self.width > vocab:  # the draft's top-k cannot rank more tokens than its vocabulary has
            what = f"static tree rank {self.width - 1}" if self.static else f"top_k {spec.top_k}"
            raise ValueError(f"{what} is beyond the draft head's vocabulary of {vocab} tokens: at most "
                             f"{vocab - 1 if self.static else vocab}")
        self.idle_rounds = 0  # rounds since any sequence drafted
        # every level of a round's trees in one native call where it runs (_native_tree), and
        # short catch-ups in forwards the native head stack takes (_catchup_chunk);
        # EAGLE_SERVE_NATIVE_DRAFT=0 keeps the per-level Python path and one-forward catch-ups
        # (tests compare the two)
        self.native_tree = os.environ.get("EAGLE_SERVE_NATIVE_DRAFT", "1") != "0"
        self.catchup_seconds = 0.0  # head forwards that consumed backlogs (see sync), cumulative
        self.catchup_pairs = 0  # the pairs they consumed, cumulative

    def observe(self, step, tokens, features, reset):
        self.observe_many([(step, tokens, reset)], features)

    def observe_many(self, items: list[tuple[SeqStep, list[int], bool]], features: torch.Tensor) -> None:
        """observe() for several sequences' (step, tokens, reset) at once, `features` their rows
        in order: one write into the feature cache."""
        slots = []
        for step, tokens, reset in items:
            state = self.states.get(step.seq_id)
            if reset or state is None:
                self.states[step.seq_id] = state = self._reset(step)
            slots.extend(self._slots(step.block_table, state.draft_len + len(state.tokens), len(tokens)))
            state.tokens.extend(tokens)
        if len(slots) != features.shape[0]:
            raise ValueError(f"{len(slots)} observed tokens with {features.shape[0]} feature rows")
        if slots:
            self.features.index_copy_(0, torch.tensor(slots, device=self.device), features)
            written = self.head_written
            for x in slots:  # new features: the head's KV at these slots is not theirs yet
                written[x] = 0

    def _reset(self, step: SeqStep) -> HeadState:
        """A sequence's head state at admission. Positions before num_cached came with a
        prefix-cache hit: their target KV and features sit in the shared blocks, but the head's
        KV there is only written once a sequence consumed their pairs (one that decoded plainly
        and finished never did). So the pairs from the first unwritten position on are pending
        again: their features are read from the feature cache, their tokens from the history.
        Written slots are never rewritten: another sequence may hold them. The last shared
        position's pair may therefore carry the next token of the sequence that wrote it (one
        position of the head's input; the draft is only ever a proposal)."""
        n = step.num_cached
        if n <= 0:
            return HeadState()
        slots = self._slots(step.block_table, 0, n)
        start = next((p for p, x in enumerate(slots) if not self.head_written[x]), n)
        return HeadState(draft_len=start, tokens=list(step.history[start + 1:n + 1]))

    def _slots(self, block_table: list[int], start: int, n: int) -> list[int]:
        bs = self.block_size
        if n == 1:  # a plain step's one pair, most calls
            return [block_table[start // bs] * bs + start % bs]
        return [block_table[p // bs] * bs + p % bs for p in range(start, start + n)]

    def _consume(self, steps: list[SeqStep], counts: list[int]) -> torch.Tensor:
        """The features of the first counts[i] pending pairs of each step's sequence, stacked;
        their slots are marked written (the caller's head forward writes their KV)."""
        slots = [x for s, k in zip(steps, counts) for x in self._slots(s.block_table, self.states[s.seq_id].draft_len, k)]
        written = self.head_written
        for x in slots:
            written[x] = 1
        # consecutive slots (one sequence's pairs within a block, most rounds) as a view: the head
        # reads them before the cache is written again
        return take_rows(self.features, slots)

    def backlog(self, seq_id: int) -> int:
        state = self.states.get(seq_id)
        return len(state.tokens) if state is not None else 0

    def release(self, seq_id):
        self.states.pop(seq_id, None)
        self._confidence.pop(seq_id, None)

    @torch.inference_mode()
    def propose(self, steps: list[SeqStep], max_depths: list[int]) -> list[DraftTree]:
        trees = [root_only(s.token_ids[-1]) for s in steps]
        active = [i for i, (s, d) in enumerate(zip(steps, max_depths))
                  if d >= 1 and self.states.get(s.seq_id) and self.states[s.seq_id].tokens]
        if not active:
            return trees
        self.idle_rounds = 0
        backlog = [steps[i] for i in active if len(self.states[steps[i].seq_id].tokens) > CATCHUP_SPLIT]
        if backlog:  # a drafting round after a while without: the backlog's forward is timed apart
            self._catch_up(backlog, keep=1)
        growths = self._native_tree([steps[i] for i in active], [max_depths[i] for i in active])
        if growths is None:
            growths = self._first_depth([steps[i] for i in active], [max_depths[i] for i in active])
            for depth in range(2, max(g.max_depth for g in growths) + 1):
                todo = [j for j, g in enumerate(growths) if g.max_depth >= depth and g.frontier]
                if todo:
                    self._grow([steps[active[j]] for j in todo], [growths[j] for j in todo], depth)
        for j, i in enumerate(active):
            g = growths[j]
            ok = self.allowed(steps[i].seq_id, g.cands.tokens, g.cands.parents) if self.allowed else None
            trees[i] = self._tree(steps[i].token_ids[-1], g, steps[i].tree_tokens, ok)
            nodes = sorted(((sc, d) for sc, d in zip(g.cands.scores, g.depths) if d <= g.max_depth),
                           key=lambda x: -x[0])[:MAX_CONFIDENCE]
            self._confidence[steps[i].seq_id] = (tuple(math.exp(sc) for sc, _ in nodes), tuple(d for _, d in nodes))
        return trees

    @torch.inference_mode()
    def sync(self, steps: list[SeqStep]) -> None:
        """Consume the pending pairs of sequences that do not draft this round once SYNC_BACKLOG
        have piled up, while the engine drafts at all (`steps`: those the tree budget keeps in
        step, possibly none; a sequence it retired is left out, see TreeBudget.choose). Without it a sequence the tree budget
        leaves undrafted for a while piles up pairs, and the round that drafts it again pays for
        the whole backlog at once (a prefill-sized head forward); syncing every round instead
        costs a head forward per token (~12% of a plain step at one sequence). The catch-up
        costs the same head FLOPs whenever it happens, so it is put off: a sequence that
        finishes before its backlog reaches SYNC_BACKLOG never pays it. When no sequence has
        drafted for IDLE_ROUNDS rounds (the budget decodes plainly under load) the catch-ups
        wait for the next draft, except past MAX_BACKLOG pairs: sequences that finish in the
        meantime never pay for their prompts' pairs (2% of the rounds at 16 sequences, by
        cProfile). Pending pairs' features sit in the feature cache (hidden size x dtype bytes a
        token: 1.1 KB for the default model, 4.6 KB with its fused features), as many slots as
        the KV cache's and counted in its memory budget."""
        self.idle_rounds += 1
        limit = MAX_BACKLOG if self.idle_rounds > IDLE_ROUNDS else SYNC_BACKLOG
        todo = [s for s in steps if self.states.get(s.seq_id) is not None
                and len(self.states[s.seq_id].tokens) >= limit]
        if todo:
            self._catch_up(todo, keep=0)

    def _catch_up(self, steps: list[SeqStep], keep: int) -> None:
        """Consume all but the last `keep` pending pairs of each sequence in one head forward,
        its seconds added to `catchup_seconds` (the loop leaves them out of the round time the
        tree budget's cost model learns: a backlog is not what a round costs)."""
        t0 = time.perf_counter()
        states = [self.states[s.seq_id] for s in steps]
        counts = [len(st.tokens) - keep for st in states]  # pairs consumed now, per sequence
        spans = [SeqSpan(st.tokens[:k], st.draft_len, s.block_table) for s, st, k in zip(steps, states, counts)]
        self._backlog_forward(spans, self._consume(steps, counts))
        for st, k in zip(states, counts):
            st.draft_len += k
            st.tokens = st.tokens[k:]
        self.catchup_pairs += sum(counts)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.catchup_seconds += time.perf_counter() - t0

    def _backlog_forward(self, spans: list[SeqSpan], feats: torch.Tensor, chunk: int | None = None) -> None:
        """The head over backlogs of pending pairs (causal spans, `feats` their rows in order):
        in forwards of at most `chunk` pairs each, sequence by sequence, where chunk (None:
        _catchup_chunk's) is non-zero, else one forward for all."""
        chunk = self._catchup_chunk(sum(len(s.token_ids) for s in spans)) if chunk is None else chunk
        if not chunk:
            self._head_forward(spans, feats)
            return
        row = 0
        for s in spans:
            k = len(s.token_ids)
            for a in range(0, k, chunk):
                b = min(k, a + chunk)
                self._head_forward([SeqSpan(s.token_ids[a:b], s.num_cached + a, s.block_table)],
                                   feats[row + a:row + b])
            row += k

    def _catchup_chunk(self, pairs: int = 0) -> int:
        """Pairs a catch-up forward of `pairs` pending pairs in all takes at most: the native head
        stack's rows where it runs them (its fc and fused-feature projections too) and the
        backlog is at most CATCHUP_CHUNKED_MAX pairs, else 0: one forward for the whole backlog
        (the Python path, oneDNN products and SDPA, past the stack's rows). One sequence's short
        backlog (a prompt's, at its first draft) costs the Python path a new oneDNN shape each
        time; longer and batched ones are cheaper there than in 16-row chunks. The head's KV
        then comes from the kernels its per-round levels use; drafts are only proposals, so
        outputs cannot change."""
        if not self.native_tree or pairs > CATCHUP_CHUNKED_MAX:
            return 0
        return self.head.native_rows(self.backend)

    def confidence(self, seq_id: int) -> tuple[tuple[float, ...], tuple[int, ...]]:
        return self._confidence.pop(seq_id, ((), ()))

    def _head_forward(self, spans: list[SeqSpan], feats: torch.Tensor) -> torch.Tensor:
        batch = build_forward_batch(spans, self.block_size, self.device)
        embeds = self.embed(batch.input_ids)
        return self.head(embeds, feats, batch, self.kv, self.backend, self.rotary)

    def _head_level(self, spans: list[SeqSpan], feats: torch.Tensor, top_rows: torch.Tensor | None = None):
        """A draft level: the head's forward over the spans, then the top `width` draft tokens
        of the rows `top_rows` (None: all). Returns (hidden, those rows' hidden, log-probs as
        lists, target ids as lists): one native call where it runs (EagleHead.level; about a
        dozen Python-level ops fewer a level), else the Python path, with the same numbers."""
        batch = build_forward_batch(spans, self.block_size, self.device)
        embed = self.embed
        fused = self.head.level(batch, embed, feats, self.kv, self.backend, self.rotary, self.width, top_rows)
        if fused is not None:
            hidden, rows, values, indices = fused
        else:
            hidden = self.head(embed(batch.input_ids), feats, batch, self.kv, self.backend, self.rotary)
            rows = hidden if top_rows is None else hidden[top_rows]
            values, indices = self.head.draft_topk(rows, self.target, self.width)
        return hidden, rows, values.tolist(), indices.tolist()

    def _native_tree(self, steps: list[SeqStep], max_depths: list[int]) -> list[Growth] | None:
        """Every level of the round's EAGLE-2 trees in one native call (EagleHead.tree:
        _first_depth and each _grow with the same kernels, numbers and bookkeeping, without a
        Python round trip a level), or None where the Python path must run: EAGLE-1's static
        trees, `native_tree` off, or a level the native head does not take (EagleHead.tree_runs)."""
        if not self.native_tree or self.static:
            return None
        states = [self.states[s.seq_id] for s in steps]
        pending = [st.tokens for st in states]
        # a level's most rows: the first (every pending pair), or every sequence's top_k frontier
        rows = max(sum(len(t) for t in pending), len(steps) * self.width)
        embed = self.embed
        if not self.head.tree_runs(rows, self.backend, embed, self.features.dtype):
            return None
        tokens, parents, scores, depths, counts = self.head.tree(
            pending, [st.draft_len for st in states], [s.block_table for s in steps], max_depths,
            self._consume(steps, [len(t) for t in pending]), embed, self.kv, self.rotary, self.width,
            self.spec.top_k, self.block_size)
        for st in states:
            st.draft_len += len(st.tokens)
            st.tokens = []
        tokens, parents, scores, depths = tokens.tolist(), parents.tolist(), scores.tolist(), depths.tolist()
        growths, at = [], 0
        for n, d in zip(counts.tolist(), max_depths):
            cut = slice(at, at + n)
            growths.append(Growth(Candidates(tokens[cut], parents[cut], scores[cut]), depths[cut], [], _NONE,
                                  max_depth=d))
            at += n
        return growths

    def _first_depth(self, steps: list[SeqStep], max_depths: list[int]) -> list[Growth]:
        """Consume every pending pair; the last one's prediction gives the root's children."""
        states = [self.states[s.seq_id] for s in steps]
        spans = [SeqSpan(st.tokens, st.draft_len, s.block_table) for s, st in zip(steps, states)]
        ends = torch.tensor([len(st.tokens) for st in states]).cumsum(0) - 1
        # last: [B, h] predicted feature of the root's position
        _, last, values, indices = self._head_level(spans, self._consume(steps, [len(st.tokens) for st in states]),
                                                    ends.to(self.device))
        for st in states:
            st.draft_len += len(st.tokens)
            st.tokens = []
        ranks = self._children[()] if self.static else list(range(self.width))
        growths = []
        for b, d in enumerate(max_depths):
            cands = Candidates([indices[b][r] for r in ranks], [-1] * len(ranks), [values[b][r] for r in ranks])
            g = Growth(cands, [1] * len(ranks), [], last[b:b + 1], max_depth=d)
            g.static_paths = {c: (r,) for c, r in enumerate(ranks)} if self.static else {}
            g.frontier = self._next_frontier(g, list(range(len(ranks))))
            g.frontier_feats = last[b:b + 1].expand(len(g.frontier), -1)
            growths.append(g)
        return growths

    def _grow(self, steps: list[SeqStep], growths: list[Growth], depth: int) -> None:
        """Expand every frontier node of depth `depth - 1` in one batched head forward."""
        spans, feats = [], []
        for s, g in zip(steps, growths):
            base = self.states[s.seq_id].draft_len
            n_prev = len(g.scratch)
            spans.append(SeqSpan([g.cands.tokens[c] for c in g.frontier], base + n_prev, s.block_table,
                                 positions=[base + depth - 2] * len(g.frontier),
                                 tree_mask=self._mask(g), num_masked_cached=n_prev))
            feats.append(g.frontier_feats)
        hidden, _, values, indices = self._head_level(spans, torch.cat(feats))
        row = 0
        for g in growths:
            expanded, new = list(g.frontier), []
            rows = list(range(row, row + len(expanded)))
            row += len(expanded)
            g.scratch.extend(expanded)
            for c, r in zip(expanded, rows):
                for rank in self._ranks(g, c):
                    new.append(len(g.cands.tokens))
                    g.cands.tokens.append(indices[r][rank])
                    g.cands.parents.append(c)
                    g.cands.scores.append(g.cands.scores[c] + values[r][rank])
                    g.depths.append(depth)
                    if self.static:
                        g.static_paths[new[-1]] = g.static_paths[c] + (rank,)
            nxt = self._next_frontier(g, new) if depth < g.max_depth else []
            parent_rows = torch.tensor([rows[expanded.index(g.cands.parents[c])] for c in nxt], dtype=torch.long)
            g.frontier, g.frontier_feats = nxt, hidden[parent_rows.to(self.device)]

    def _ranks(self, g: Growth, cand: int) -> list[int]:
        if self.static:
            return self._children.get(g.static_paths[cand], [])
        return list(range(self.width))

    def _next_frontier(self, g: Growth, new: list[int]) -> list[int]:
        """EAGLE-2: the top_k new candidates by cumulative score; EAGLE-1: those with children."""
        if self.static:
            return [c for c in new if self._children.get(g.static_paths[c])]
        best = sorted(new, key=lambda c: (-g.cands.scores[c], c))[:self.spec.top_k]
        return sorted(best)

    def _mask(self, g: Growth) -> torch.Tensor:
        """[F, S + F]: frontier node i sees scratch pair j iff j is i's ancestor, and itself."""
        keys = g.scratch + g.frontier
        rows = []
        for c in g.frontier:
            seen = set()
            while c >= 0:
                seen.add(c)
                c = g.cands.parents[c]
            rows.append([k in seen for k in keys])
        return torch.tensor(rows, dtype=torch.bool)

    def _tree(self, root: int, g: Growth, total: int | None, allowed: list[bool] | None = None) -> DraftTree:
        """The kept candidates (EAGLE-2: the best `total - 1` by score) among those within the
        depth and, for a structured sequence, those its grammar allows (`allowed`)."""
        cands = g.cands
        ok = [c for c in range(len(cands)) if g.depths[c] <= g.max_depth and (allowed is None or allowed[c])]
        if self.static and total is None:
            keep = ok
        else:
            sub = Candidates([cands.tokens[c] for c in ok], [cands.parents[c] for c in ok],
                             [cands.scores[c] for c in ok])
            keep = [ok[i] for i in select_best(sub, (total or self.spec.total_tokens) - 1)]
        return build_tree(root, cands, keep)


def feature_width(hidden_size: int, aux_layers) -> int:
    """Per token, what the target hands a head: its final feature, and one residual stream per
    fused layer."""
    return hidden_size * (1 + len(aux_layers))


def _static_children(paths) -> dict[tuple[int, ...], list[int]]:
    children: dict[tuple[int, ...], list[int]] = {}
    for p in sorted(set(map(tuple, paths)), key=lambda p: (len(p), p)):
        children.setdefault(p[:-1], []).append(p[-1])
    return children


def _rotary(cfg):
    return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
