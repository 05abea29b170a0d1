"""The engine executor: owns model, KV tensors and backend; runs one packed forward per step."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch

from eagle_serve.engine import hugepages, kernels
from eagle_serve.engine.attention import make_backend
from eagle_serve.engine.config import EngineConfig
from eagle_serve.engine.cuda_graphs import GraphRunner, scratch_blocks
from eagle_serve.engine.forward_batch import SeqSpan, take_rows
from eagle_serve.engine.gpu_memory import cuda_kv_cache_tokens, engine_kv_bytes_per_token
from eagle_serve.engine.kv_cache import KVCache
from eagle_serve.engine.layers import FAST_DTYPES
from eagle_serve.engine.loader import LoadedModel, load_model
from eagle_serve.engine.sampler import GrammarMasks, Picks, PicksView, SampleRow
from eagle_serve.engine.speculative.accept import walk
from eagle_serve.engine.speculative.drafters import Drafter, NgramDrafter, NoDrafter
from eagle_serve.engine.speculative.eagle_drafter import EagleDrafter
from eagle_serve.engine.speculative.eagle3_head import load_draft_head
from eagle_serve.engine.speculative.tree import DraftTree, prune, root_only
from eagle_serve.engine.step_io import SeqResult, SeqStep
from eagle_serve.engine.structured import Grammars, GrammarState
from eagle_serve.engine.structured import allocate as allocate_bitmask


@dataclass
class PhaseTimes:
    """Wall seconds spent per phase of `execute` (draft; target forward + sampling = verify;
    acceptance, KV compaction and draft bookkeeping = accept), for benchmarks."""

    draft: float = 0.0
    verify: float = 0.0
    accept: float = 0.0
    steps: int = 0

    def add(self, draft: float, verify: float, accept: float) -> None:
        self.draft += draft
        self.verify += verify
        self.accept += accept
        self.steps += 1


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device cuda was requested but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    # bf16 halves the bytes read per token; it pays with native bf16 dot products or the native
    # kernels' AVX2 build (bf16 converted in registers), and with neither torch's bf16 is emulated
    # (bench/bench_decode.py).
    fast = torch.ops.mkldnn._is_mkldnn_bf16_supported() or kernels.native() is not None
    return torch.bfloat16 if fast else torch.float32


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        """loaded: a model built in memory (bench/gpu_check.py) instead of loading config.model."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.loaded: LoadedModel = loaded if loaded is not None else load_model(
            config.model, self.dtype, self.device, config.skip_tokenizer, config.quantization)
        self.model = self.loaded.model
        self.num_prepacked = self.model.prepack() if self.device.type == "cpu" else 0
        cfg = self.loaded.config
        self.num_blocks = self._num_blocks()
        # + the CUDA graphs' scratch block for padded writes (none on the CPU), never handed out
        self.kv = KVCache(cfg.num_layers, self.num_blocks + scratch_blocks(self.device, config.cuda_graphs),
                          config.block_size, cfg.num_kv_heads,
                          cfg.head_dim, self.dtype, self.device)
        self.max_model_len = self._max_model_len()
        self.backend = make_backend(cfg.head_dim ** -0.5, self.device, self.dtype, config.attention)
        self.spec = config.spec
        self.draft_int8 = False  # whether the draft head keeps int8 weights (_draft_int8)
        self.draft_int8_inputs = False  # and rounds their inputs to 8 bits too (w8a8)
        self.drafter = self._make_drafter()
        if self.device.type == "cpu":
            hugepages.trim_heap()  # the load's freed staging copies back to the OS
        self.timings = PhaseTimes()
        self.graphs = GraphRunner.for_runner(self)  # CUDA graphs for decode / verify; eager on the CPU
        # Fault injection (tests, chaos runs): called with each round's steps after drafting,
        # inside the step; whatever it raises fails the step like a real engine error.
        self.fault_hook = None
        self._grammars = None  # structured output's compiler, built on first use (`grammars`)
        self._grammars_lock = threading.Lock()
        self.grammar_states: dict[int, GrammarState] = {}  # seq -> its matcher, for structured requests

    @property
    def grammars(self) -> Grammars:
        """The structured-output compiler for this model's tokenizer (built on first use: reading
        the vocabulary takes a fraction of a second). ValueError without a tokenizer."""
        if self._grammars is None:
            if self.loaded.tokenizer is None:
                raise ValueError("structured output needs a tokenizer (this engine was built with skip_tokenizer)")
            with self._grammars_lock:
                if self._grammars is None:
                    self._grammars = Grammars(self.loaded.tokenizer, self.loaded.config.vocab_size,
                                              self.loaded.eos_token_ids)
        return self._grammars

    def _num_blocks(self) -> int:
        c, m = self.config, self.loaded.config
        tokens = c.kv_cache_tokens
        if tokens is None:
            if self.device.type == "cuda":  # gpu_memory_utilization of the GPU, after weights and activations
                budget = cuda_kv_cache_tokens(self)
            else:
                per_token = engine_kv_bytes_per_token(c, m, self.dtype)
                budget = int(_memory_bytes(self.device) * c.kv_cache_memory_fraction) // per_token
            tokens = min(budget, c.max_num_seqs * m.max_model_len)
        return max(1, tokens // c.block_size)

    def _max_model_len(self) -> int:
        model_len = self.loaded.config.max_model_len
        cache_len = self.num_blocks * self.config.block_size
        if self.config.max_model_len is not None:
            if self.config.max_model_len > model_len:
                raise ValueError(f"max_model_len {self.config.max_model_len} exceeds the model's "
                                 f"context {model_len}")
            if self.config.max_model_len > cache_len:
                raise ValueError(f"max_model_len {self.config.max_model_len} does not fit in the KV "
                                 f"cache ({cache_len} tokens); raise kv_cache_tokens")
            return self.config.max_model_len
        return min(model_len, cache_len)

    def _make_drafter(self) -> Drafter:
        spec = self.spec
        if spec.method == "none":
            return NoDrafter()
        if spec.method == "ngram":
            return NgramDrafter(spec.ngram_max, spec.ngram_min, spec.max_depth)
        if self.config.draft is None:
            raise ValueError(f"spec method {spec.method!r} needs a draft head (--draft PATH); this model "
                             f"has none: use --spec ngram or --spec none")
        int8 = self._draft_int8()
        head = load_draft_head(self.config.draft, self.model, self.dtype, spec.method).to(self.device)
        if self.device.type == "cpu":
            head.prepack(int8=int8, int8_inputs=self.draft_int8_inputs)
        # a fused-feature or EAGLE-3 head reads the target's features [f ; aux]: every forward returns them
        self.model.set_aux_layers(head.aux_layers)
        return EagleDrafter(head, self.model, spec, self.num_blocks, self.config.block_size, self.dtype, self.device,
                            self.config.attention)

    def _draft_int8(self) -> bool:
        """Whether the head keeps int8 weights (EngineConfig.draft_quantization): auto where the
        native CPU kernels run in float32 / bfloat16; int8 where they cannot is refused. w8a8
        also rounds their inputs (`draft_int8_inputs`), where the kernels have VNNI, and so does
        auto there: the faster draft outweighs the slightly fewer accepted tokens (bench/bench_spec.py
        --draft-quantization w8a8 --compare-quantization int8)."""
        mod = kernels.native() if self.device.type == "cpu" and self.dtype in FAST_DTYPES else None
        able = mod is not None and hasattr(mod, "pack_int8")
        q = self.config.draft_quantization
        if q in ("int8", "w8a8") and not able:
            raise ValueError(f"draft_quantization {q} needs the native CPU kernels (float32 or bfloat16 on the CPU); "
                             "use auto or none")
        if q == "w8a8" and not mod.int8_inputs_available():
            raise ValueError("draft_quantization w8a8 needs the AVX-512 build of the native kernels (VNNI dot "
                             "products); use auto, int8 or none")
        self.draft_int8 = able and q in ("auto", "int8", "w8a8")
        self.draft_int8_inputs = q == "w8a8" or (q == "auto" and able and mod.int8_inputs_available())
        return self.draft_int8

    @property
    def catchup_seconds(self) -> float:
        """Seconds the drafter spent consuming backlogs of pending pairs (cumulative)."""
        return self.drafter.catchup_seconds

    @property
    def catchup_pairs(self) -> int:
        """The pairs those catch-ups consumed (cumulative)."""
        return self.drafter.catchup_pairs

    def release(self, seq_id: int) -> None:
        self.drafter.release(seq_id)
        self.grammar_states.pop(seq_id, None)

    @torch.inference_mode()
    def execute(self, steps: list[SeqStep]) -> list[SeqResult]:
        """One round for every step: draft trees for decoding sequences, one packed target
        forward (prefill chunks and trees together), tree acceptance, KV compaction."""
        t0 = time.perf_counter()
        for s in steps:
            if s.restart:  # (re)admitted: whatever the drafter kept from before is stale
                self.drafter.release(s.seq_id)
        grammar = self._grammar_states(steps)
        trees, drafted = self._draft(steps, grammar)
        if self.fault_hook is not None:
            self.fault_hook(steps)
        t1 = time.perf_counter()
        spans = [self._span(s, t) for s, t in zip(steps, trees)]
        hidden = self.forward(spans)
        offsets = [0]
        for span in spans:
            offsets.append(offsets[-1] + len(span.token_ids))
        roots = [offsets[i] + len(s.token_ids) - 1 for i, s in enumerate(steps)]
        sampled = [i for i, s in enumerate(steps) if s.sample]
        rows, sample_rows, lazy = [], [], set()
        for i in sampled:
            if len(trees[i]) > 1:  # a tree's nodes are drawn as its walk reads them (Picks)
                lazy.update(range(len(rows), len(rows) + len(trees[i])))
            rows.extend(range(roots[i], roots[i] + len(trees[i])))
            sample_rows.extend(node_rows(steps[i], trees[i]))
        picks = None
        if rows:  # a round of prompt chunks that reach no prompt's end samples nothing
            # the first hidden columns only: a fused-feature head's [f ; aux] rows would be
            # gathered whole and then sliced again (the LM head reads f)
            logits = self.model.compute_logits(take_rows(hidden[:, :self.loaded.config.hidden_size], rows))
            picks = Picks(logits, sample_rows, self.loaded.eos_token_ids, lazy,
                          self._masks(steps, trees, sampled, grammar, len(rows)) if grammar else None)
        t2 = time.perf_counter()
        # what the head observes this round: (step, tokens, reset) and each token's feature row,
        # written to the drafter in one call
        observed, feature_rows = [], []
        if self.drafter.needs_features:  # prefill chunks that sample nothing still feed the head
            for i, s in enumerate(steps):
                if not s.sample:
                    nxt = s.history[s.num_cached + len(s.token_ids)]
                    observed.append((s, s.token_ids[1:] + [nxt], s.restart))
                    feature_rows.extend(range(offsets[i], offsets[i + 1]))
        fields, k = [], 0
        for i in sampled:
            n = len(trees[i])
            fields.append(self._accept(steps[i], trees[i], picks.view(k), roots[i], drafted[i], observed, feature_rows))
            k += n
        if observed:
            self.drafter.observe_many(observed, take_rows(hidden, feature_rows))
        backlog = self.drafter.backlog  # after this round's pairs went in
        results = [SeqResult(*f, head_backlog=backlog(f[0])) for f in fields]
        self.timings.add(draft=t1 - t0, verify=t2 - t1, accept=time.perf_counter() - t2)
        return results

    def forward(self, spans: list[SeqSpan]) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of the packed new tokens ([T, (1 + n) hidden]
        with a fused-feature head's n aux layers: LlamaForCausalLM.set_aux_layers): a CUDA graph
        replay where the batch fits a captured bucket, else the eager forward."""
        return self.graphs.forward(spans, self.backend)

    def _grammar_states(self, steps: list[SeqStep]) -> dict[int, GrammarState]:
        """The matchers of this round's structured sampled steps, brought up to their committed
        outputs (made afresh for a (re)admitted sequence: preemption, recompute, a retried step)."""
        out = {}
        for s in steps:
            spec = s.params.structured
            if spec is None or not s.sample:
                continue
            state = self.grammar_states.get(s.seq_id)
            if s.restart or state is None or state.num_accepted > len(s.output_token_ids):
                state = self.grammar_states[s.seq_id] = self.grammars.state(spec)
            state.sync(s.output_token_ids)
            out[s.seq_id] = state
        return out

    def _masks(self, steps: list[SeqStep], trees: list[DraftTree], sampled: list[int],
               grammar: dict[int, GrammarState], num_rows: int) -> GrammarMasks:
        """Each structured step's bitmask at every node of its tree (the root: its next token),
        rows in the round's sampling order."""
        bitmask = allocate_bitmask(num_rows, self.loaded.config.vocab_size)
        rows, k = [], 0
        for i in sampled:
            n = len(trees[i])
            state = grammar.get(steps[i].seq_id)
            if state is not None:
                state.tree_masks(trees[i].tokens, trees[i].parents, bitmask[k:k + n])
                rows.extend(range(k, k + n))
            k += n
        return GrammarMasks(bitmask, rows, self.loaded.config.vocab_size)

    def _draft(self, steps: list[SeqStep], grammar: dict[int, GrammarState]) -> tuple[list[DraftTree], list[int]]:
        """A tree per step (root only where nothing is drafted) and the levels drafted for it.
        A structured step's tree holds only candidates its grammar allows (EAGLE-2 picks its
        nodes among those; other drafters' trees are pruned after)."""
        trees = [root_only(s.token_ids[-1]) for s in steps]
        depths = [min(self.spec.max_depth, s.max_new_tokens - 1,
                      s.tree_depth if s.tree_depth is not None
                      else self.spec.max_depth if s.tree_tokens is None else s.tree_tokens - 1) for s in steps]
        # decoding: a sampled one-token step past a computed prefix that has output already (not
        # a one-token prompt chunk, nor a prompt's last token after a prefix-cache hit)
        decodes = [s.sample and s.num_cached > 0 and not s.feeds_prompt for s in steps]
        decoding = [i for i, d in enumerate(decodes) if d and depths[i] > 0]
        idle = [s for i, (s, d) in enumerate(zip(steps, decodes)) if d and depths[i] <= 0]
        if idle:  # called even when every one is retired: the drafter counts rounds without a draft
            self.drafter.sync([s for s in idle if s.head_sync])
        if decoding:
            def allowed(seq_id, tokens, parents):
                state = grammar.get(seq_id)
                return None if state is None else state.valid_candidates(tokens, parents)
            self.drafter.allowed = allowed if grammar else None
            proposed = self.drafter.propose([steps[i] for i in decoding], [depths[i] for i in decoding])
            for i, tree in zip(decoding, proposed):
                ok = None if self.drafter.filters_candidates or len(tree) == 1 else \
                    allowed(steps[i].seq_id, tree.tokens[1:], [p - 1 for p in tree.parents[1:]])
                trees[i] = tree if ok is None else prune(tree, ok)
        return trees, [d if len(t) > 1 else 0 for d, t in zip(depths, trees)]

    @staticmethod
    def _span(step: SeqStep, tree: DraftTree) -> SeqSpan:
        if len(tree) == 1:
            return SeqSpan(step.token_ids, step.num_cached, step.block_table,
                           prompt_len=len(step.prompt_token_ids) + len(step.output_token_ids) if step.feeds_prompt else 0)
        assert len(step.token_ids) == 1, "trees follow a single uncomputed token"
        return SeqSpan(tree.tokens, step.num_cached, step.block_table,
                       positions=[step.num_cached + d for d in tree.depths], tree_mask=tree.ancestor_mask())

    def _accept(self, step: SeqStep, tree: DraftTree, chosen: PicksView, root_row: int,
                drafted_depth: int, observed: list, feature_rows: list[int]) -> tuple:
        """Walk the tree, compact the accepted nodes' KV; what the head is to observe goes on
        `observed` / `feature_rows` (execute hands them over for the whole round at once).
        Returns the step's SeqResult fields but the head's backlog, in order (execute builds
        the result once the round's pairs are in)."""
        verdict = walk(tree, chosen)
        path = [0] + verdict.accepted_nodes
        root_pos = step.num_cached + len(step.token_ids) - 1
        if verdict.accepted_nodes:
            self._compact(step.block_table, root_pos, verdict.accepted_nodes)
        if self.drafter.needs_features:
            if len(tree) == 1:  # prefill (or a plain step): every fed position pairs with its successor
                feature_rows.extend(range(root_row - len(step.token_ids) + 1, root_row + 1))
                observed.append((step, step.token_ids[1:] + verdict.tokens, step.restart))
            else:
                feature_rows.extend(root_row + n for n in path)
                observed.append((step, verdict.tokens, step.restart))
        lps = [chosen.logprobs(n) for n in path] if step.params.logprobs is not None else None
        conf, conf_depths = self.drafter.confidence(step.seq_id) if len(tree) > 1 else ((), ())
        return (step.seq_id, verdict.tokens, lps, len(tree) - 1, (1,) * len(verdict.accepted_nodes), conf,
                conf_depths, drafted_depth)

    def _compact(self, block_table: list[int], root_pos: int, nodes: list[int]) -> None:
        """Move accepted nodes' KV from their scratch positions to root_pos + 1, + 2, ..."""
        bs = self.config.block_size
        slot = lambda p: block_table[p // bs] * bs + p % bs  # noqa: E731
        data = self.kv.data
        # node by node in order: nodes ascend and nodes[j] >= j + 1, so a move's destination is
        # below every later source and no source is overwritten before it is read; a node already
        # in place (an accepted chain of first children) moves nothing. (The advanced-index
        # gather and scatter this replaces took 116 us for two nodes, two copy_ 18, by timeit.)
        for j, n in enumerate(nodes, 1):
            if n != j:
                data[:, :, slot(root_pos + j)].copy_(data[:, :, slot(root_pos + n)])


def node_rows(step: SeqStep, tree: DraftTree) -> list[SampleRow]:
    """The target's sampling context at every node: output position and history grow with depth
    (penalties count the node's ancestors)."""
    rows = []
    for node in range(len(tree)):
        path_tokens = [tree.tokens[n] for n in tree.path(node)[1:]]
        rows.append(SampleRow(step.params, step.seed, step.output_position + tree.depths[node],
                              step.output_token_ids + path_tokens))
    return rows
