"""CUDA graphs for the target's decode / verify forward (see docs/gpu.md).

A decode or tree-verify step is a few tokens per sequence through every layer: on a GPU its
time is mostly kernel launches (hundreds per forward), not arithmetic. `GraphRunner` captures
the forward once per shape and replays it.

Shapes. A captured graph has fixed tensor shapes, so a batch is padded up to a bucket key
(B, Q, L): B sequences (batch bucket), Q new tokens per sequence (tokens bucket: the largest
tree or chunk in the batch) and L keys per sequence (kv bucket: the longest sequence's keys).
Each is the smallest configured size >= the value (`bucket_for`); a batch beyond the largest
size of any of the three runs eager. Graphs are captured lazily, on a key's first use (and
never again; a key whose capture failed stays eager), all into one shared memory pool.

Padding (`pad_spans`). Every sequence gets exactly Q query rows (row b * Q + i). Padded tokens
(rows past a sequence's own n) and padded sequences (b >= the real count) write their K/V to
one reserved scratch block that the block allocator never hands out (the KV cache has one block
more than `ModelRunner.num_blocks`), read only key 0 of their own row (so the softmax stays
finite), and their outputs are dropped. Real tokens see exactly the keys the eager forward lets
them see, so their outputs equal the eager ones (up to the kernels' rounding).

Static inputs (copied into before each replay): input ids, RoPE positions, slot mapping
[B * Q] int64, block tables [B, L / block_size] int32, committed and new token counts [B] int32,
and the mask among the new tokens [B, Q, Q] bool (a tree's ancestor mask; causal for a chain or
a prefill chunk). Inside the graph `expand_batch` turns these into the gather indices and the
[B, 1, Q, L] mask, and `PaddedAttention` runs one SDPA per layer over the gathered keys, with
the query heads of each KV head stacked on the query axis (grouped-query attention without
`enable_gqa`, so the memory-efficient kernel can take the mask). The configured attention
backend (torch, flash) serves the eager forwards only: the flash backend plans on the host
every batch, which a graph cannot replay.

What is captured: the target's decoder stack (embedding to final norm) for batches whose
sequences all fit a bucket: decode steps, tree verification, and short prefill chunks. What
runs eager: longer prefill chunks and anything past the largest bucket, the LM head and
sampling (only the real rows' logits are computed), the EAGLE head's drafting, KV compaction.
On the CPU, or with `EngineConfig.cuda_graphs` off, `GraphRunner.forward` is the eager forward.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle_serve.engine.attention import AttentionBackend, TorchAttention
from eagle_serve.engine.forward_batch import ForwardBatch, SeqSpan, build_forward_batch

log = logging.getLogger(__name__)

MIN_KV_BUCKET = 256  # smallest kv bucket (keys per sequence); buckets double up to the context
# Most keys one captured forward gathers per layer (batch bucket x kv bucket). The padded SDPA
# copies every sequence's L keys once per layer; past this a batch runs eager, where the flash
# backend reads the cache in place (1 << 16 keys of Llama-3-8B: 256 MiB of K and V per layer).
MAX_GRAPH_KEYS = 1 << 16
MAX_GRAPHS = 1024  # keys captured at most; further keys run eager


# ---------------------------------------------------------------- buckets (pure)

def bucket_for(value: int, sizes: Sequence[int]) -> int | None:
    """The smallest size >= value, or None when value exceeds the largest (run eager)."""
    for s in sorted(sizes):
        if s >= value:
            return s
    return None


def powers_up_to(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `limit`, then `limit` itself: (1, 2, 4, 8, 16, 24) for 24."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    out, s = [], 1
    while s < limit:
        out.append(s)
        s *= 2
    return tuple(out + [limit])


def kv_sizes_for(max_kv: int, block_size: int, smallest: int = MIN_KV_BUCKET) -> tuple[int, ...]:
    """kv buckets: multiples of the block size doubling from `smallest` up to `max_kv` rounded
    up to a whole block (the last bucket)."""
    round_up = lambda x: -(-x // block_size) * block_size  # noqa: E731
    top = round_up(max(1, max_kv))
    out, s = [], round_up(max(smallest, block_size))
    while s < top:
        out.append(s)
        s *= 2
    return tuple(out + [top])


@dataclass(frozen=True)
class Buckets:
    batch: tuple[int, ...]
    tokens: tuple[int, ...]
    kv: tuple[int, ...]
    max_keys: int | None = MAX_GRAPH_KEYS  # batch bucket x kv bucket above this: eager (None: no cap)

    def __post_init__(self):
        for name in ("batch", "tokens", "kv"):
            sizes = getattr(self, name)
            if not sizes or min(sizes) < 1:
                raise ValueError(f"{name} bucket sizes must be positive, got {sizes}")
            object.__setattr__(self, name, tuple(sorted(set(sizes))))

    @property
    def largest(self) -> tuple[int, int, int]:
        """The largest (B, Q, L) a key can have (B x L within max_keys)."""
        B, L = max(self.batch), max(self.kv)
        if self.max_keys is not None:
            L = max([kv for kv in self.kv if kv <= self.max_keys] or [min(self.kv)])
            B = max([b for b in self.batch if b * min(self.kv) <= self.max_keys] or [1])
        return B, max(self.tokens), L

    def key(self, spans: Sequence[SeqSpan]) -> tuple[int, int, int] | None:
        """(B, Q, L) bucket of a batch, or None: run it eager."""
        if not spans or any(s.num_masked_cached for s in spans):
            return None
        b = bucket_for(len(spans), self.batch)
        q = bucket_for(max(len(s.token_ids) for s in spans), self.tokens)
        kv = bucket_for(max(s.num_cached + len(s.token_ids) for s in spans), self.kv)
        if b is None or q is None or kv is None or (self.max_keys is not None and b * kv > self.max_keys):
            return None
        return b, q, kv


def default_buckets(max_num_seqs: int, tree_tokens: int, max_kv: int, block_size: int,
                    batch_sizes: Sequence[int] | None = None, token_sizes: Sequence[int] | None = None) -> Buckets:
    """Batch: powers of two up to max_num_seqs; tokens: powers of two up to the largest tree;
    kv: doubling from MIN_KV_BUCKET up to the longest sequence (context + a tree)."""
    return Buckets(tuple(batch_sizes) if batch_sizes else powers_up_to(max_num_seqs),
                   tuple(token_sizes) if token_sizes else powers_up_to(tree_tokens),
                   kv_sizes_for(max_kv, block_size))


def graphs_enabled(device: torch.device, cuda_graphs: bool) -> bool:
    return device.type == "cuda" and cuda_graphs


def scratch_blocks(device: torch.device, cuda_graphs: bool) -> int:
    """KV blocks reserved past the allocator's for padded writes (1 where graphs run, else 0)."""
    return 1 if graphs_enabled(device, cuda_graphs) else 0


# ---------------------------------------------------------------- padding (pure, host side)

@dataclass
class PaddedInputs:
    """The static inputs of one (B, Q, L) graph, on the host (see the module doc)."""

    input_ids: torch.Tensor  # [B * Q] int64
    positions: torch.Tensor  # [B * Q] int64
    slot_mapping: torch.Tensor  # [B * Q] int64
    block_tables: torch.Tensor  # [B, L // block_size] int32
    num_cached: torch.Tensor  # [B] int32
    num_new: torch.Tensor  # [B] int32
    tree_mask: torch.Tensor  # [B, Q, Q] bool, among the new tokens
    out_rows: torch.Tensor  # [T] int64: padded row of every real token, in packed order

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.input_ids, self.positions, self.slot_mapping, self.block_tables, self.num_cached,
                self.num_new, self.tree_mask)


def pad_spans(spans: Sequence[SeqSpan], batch: int, tokens: int, kv: int, block_size: int,
              scratch_block: int) -> PaddedInputs:
    """Lay `spans` out in a (batch, tokens, kv) bucket; padding goes to `scratch_block`."""
    if len(spans) > batch:
        raise ValueError(f"{len(spans)} sequences do not fit a batch bucket of {batch}")
    if kv % block_size:
        raise ValueError(f"kv bucket {kv} is not a multiple of the block size {block_size}")
    n_blocks = kv // block_size
    scratch_slot = scratch_block * block_size
    ids = torch.zeros(batch, tokens, dtype=torch.long)
    pos = torch.zeros(batch, tokens, dtype=torch.long)
    slots = torch.full((batch, tokens), scratch_slot, dtype=torch.long)
    tables = torch.full((batch, n_blocks), scratch_block, dtype=torch.int32)
    cached = torch.zeros(batch, dtype=torch.int32)
    new = torch.zeros(batch, dtype=torch.int32)
    mask = torch.zeros(batch, tokens, tokens, dtype=torch.bool)
    rows = []
    for b, s in enumerate(spans):
        n, c = len(s.token_ids), s.num_cached
        if n > tokens or c + n > kv:
            raise ValueError(f"sequence {b} ({n} new tokens, {c + n} keys) does not fit bucket ({tokens}, {kv})")
        table = list(s.block_table[:n_blocks])
        if len(table) * block_size < c + n:
            raise ValueError(f"sequence {b}: block table too short for {c + n} keys")
        tables[b, :len(table)] = torch.tensor(table, dtype=torch.int32)
        ids[b, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        pos[b, :n] = torch.tensor(s.positions if s.positions is not None else range(c, c + n), dtype=torch.long)
        p = torch.arange(c, c + n)
        slots[b, :n] = tables[b, p // block_size].long() * block_size + p % block_size
        cached[b], new[b] = c, n
        mask[b, :n, :n] = s.tree_mask if s.tree_mask is not None else torch.ones(n, n, dtype=torch.bool).tril()
        rows.append(torch.arange(n) + b * tokens)
    return PaddedInputs(ids.view(-1), pos.view(-1), slots.view(-1), tables, cached, new, mask,
                        torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long))


# ---------------------------------------------------------------- the padded forward (capturable)

def expand_batch(input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, num_cached: torch.Tensor, num_new: torch.Tensor,
                 tree_mask: torch.Tensor, block_size: int) -> ForwardBatch:
    """A `ForwardBatch` in the padded [B * Q] layout, from the static inputs, with device ops only
    (no host sync: safe to capture). Key j of sequence b is storage position j; query i sees
    the committed keys j < c, and new key c + k where tree_mask[b, i, k]; padded rows see key 0."""
    B, n_blocks = block_tables.shape
    Q = tree_mask.shape[1]
    L = n_blocks * block_size
    dev = block_tables.device
    pos = torch.arange(L, device=dev)
    grid = block_tables.long()[:, pos // block_size] * block_size + pos % block_size  # [B, L]
    c = num_cached.long().view(B, 1, 1)
    n = num_new.long().view(B, 1, 1)
    i = torch.arange(Q, device=dev).view(1, Q, 1)
    j = pos.view(1, 1, L)
    rel = j - c  # [B, 1, L]: index among the new keys
    in_new = (rel >= 0) & (rel < n)
    tree = torch.gather(tree_mask, 2, rel.clamp(0, Q - 1).expand(B, Q, L))  # [B, Q, L]
    real_row = i < n  # [B, Q, 1]
    mask = (real_row & ((j < c) | (in_new & tree))) | (~real_row & (j == 0))
    rows = torch.arange(B * Q, device=dev)
    return ForwardBatch(
        input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, kv_gather=grid.reshape(-1),
        attn_mask=mask.unsqueeze(1), q_index=rows, num_seqs=B, max_query_len=Q, max_kv_len=L,
        kv_lens=(num_cached + num_new).long(), q_seq=rows // Q, q_row=rows % Q)


class PaddedAttention(TorchAttention):
    """Attention over a padded [B * Q] batch with fixed shapes: KV write, gather of L keys per
    sequence, one SDPA. Query heads sharing a KV head are stacked on the query axis
    ([B, Hkv, G * Q, D]) so no key is copied per query head and no `enable_gqa` is needed."""

    name = "padded"

    def forward(self, q, k, v, layer, batch, kv):
        keys, values = self.store_and_gather(k, v, layer, batch, kv)
        B, Q, L = batch.num_seqs, batch.max_query_len, batch.max_kv_len
        _, H, D = q.shape
        hkv = k.shape[1]
        g = H // hkv
        queries = q.view(B, Q, hkv, g, D).permute(0, 2, 3, 1, 4).reshape(B, hkv, g * Q, D)
        mask = batch.attn_mask if g == 1 else batch.attn_mask.expand(B, g, Q, L).reshape(B, 1, g * Q, L)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale)
        return out.reshape(B, hkv, g, Q, D).permute(0, 3, 1, 2, 4).reshape(B * Q, H * D)


# ---------------------------------------------------------------- the runner

@dataclass
class GraphStats:
    replays: int = 0
    eager: int = 0
    captures: int = 0
    capture_s: float = 0.0
    failed: int = 0


class GraphRunner:
    """Owns the target's CUDA graphs, keyed by (batch, tokens, kv) bucket (module doc).

    `forward(spans, backend)` returns the final-norm hidden states [T, hidden] of the packed new
    tokens, as `model(build_forward_batch(spans), kv, backend)` does: by graph replay where the
    batch fits a bucket and graphs are enabled, else by that eager call.
    """

    def __init__(self, model, kv, block_size: int, scratch_block: int, device: torch.device,
                 buckets: Buckets, enabled: bool, max_graphs: int = MAX_GRAPHS):
        self.model, self.kv, self.block_size, self.device = model, kv, block_size, device
        self.buckets = buckets
        self.scratch_block = scratch_block
        self.enabled = enabled and device.type == "cuda"
        self.max_graphs = max_graphs
        self.backend = PaddedAttention(model.config.head_dim ** -0.5)
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.failed: dict[tuple[int, int, int], str] = {}
        self.stats = GraphStats()
        self._pool = None
        self._buffers: tuple[torch.Tensor, ...] | None = None
        if self.enabled and scratch_block >= kv.num_blocks:
            raise ValueError(f"scratch block {scratch_block} is outside the KV cache ({kv.num_blocks} blocks)")

    @classmethod
    def for_runner(cls, runner) -> GraphRunner:
        """The runner's graphs: enabled on CUDA with `cuda_graphs`; scratch block = the KV cache's
        last block (past the allocator's `num_blocks`)."""
        c = runner.config
        enabled = graphs_enabled(runner.device, c.cuda_graphs)
        buckets = default_buckets(c.max_num_seqs, runner.spec.tree_tokens,
                                  runner.max_model_len + runner.spec.scratch_slots, c.block_size,
                                  c.cuda_graph_batch_sizes, c.cuda_graph_token_sizes)
        return cls(runner.model, runner.kv, c.block_size, runner.num_blocks, runner.device, buckets, enabled)

    # -- eager paths

    def eager(self, spans: Sequence[SeqSpan], backend: AttentionBackend) -> torch.Tensor:
        self.stats.eager += 1
        return self.model(build_forward_batch(list(spans), self.block_size, self.device), self.kv, backend)

    def padded_eager(self, spans: Sequence[SeqSpan], key: tuple[int, int, int],
                     scratch_block: int | None = None) -> torch.Tensor:
        """What a graph of `key` computes, run eagerly (any device): for tests and checks.
        scratch_block: where padding writes (default the runner's; the CPU's cache has none)."""
        scratch = self.scratch_block if scratch_block is None else scratch_block
        inputs = pad_spans(spans, *key, self.block_size, scratch)
        dev = [t.to(self.device) for t in inputs.tensors()]
        hidden = self.model(expand_batch(*dev, self.block_size), self.kv, self.backend)
        return hidden.index_select(0, inputs.out_rows.to(self.device))

    # -- graphs

    @torch.inference_mode()
    def forward(self, spans: Sequence[SeqSpan], backend: AttentionBackend) -> torch.Tensor:
        key = self.buckets.key(spans) if self.enabled else None
        graph = self._graph(key) if key is not None else None
        if graph is None:
            return self.eager(spans, backend)
        inputs = pad_spans(spans, *key, self.block_size, self.scratch_block)
        views = self._views(key)
        for dst, src in zip(views, inputs.tensors()):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        self.stats.replays += 1
        return views[-1].index_select(0, inputs.out_rows.to(self.device, non_blocking=True))

    def capture(self, keys: Sequence[tuple[int, int, int]]) -> None:
        """Capture these keys now (instead of on first use)."""
        with torch.inference_mode():
            for key in keys:
                self._graph(key)

    def _graph(self, key):
        if key in self.graphs:
            return self.graphs[key]
        if key in self.failed:
            return None
        if len(self.graphs) >= self.max_graphs:
            self.failed[key] = f"more than {self.max_graphs} graphs"
            return None
        t0 = time.perf_counter()
        try:
            graph = self._capture(key)
        except Exception as e:  # out of memory, an op that cannot be captured: this key stays eager
            log.warning("CUDA graph capture failed for (batch, tokens, kv) %s: %s; running it eager", key, e)
            self.failed[key] = f"{type(e).__name__}: {e}"
            self.stats.failed += 1
            return None
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - t0
        self.graphs[key] = graph
        return graph

    def _allocate(self) -> None:
        """Static buffers at the largest bucket, shared by every graph (each uses a prefix)."""
        B, Q, L = self.buckets.largest
        dev, cfg = self.device, self.model.config
        dtype = self.model.model.embed_tokens.weight.dtype
        self._buffers = (
            torch.zeros(B * Q, dtype=torch.long, device=dev),  # input ids
            torch.zeros(B * Q, dtype=torch.long, device=dev),  # positions
            torch.zeros(B * Q, dtype=torch.long, device=dev),  # slot mapping
            torch.zeros(B * (L // self.block_size), dtype=torch.int32, device=dev),  # block tables
            torch.zeros(B, dtype=torch.int32, device=dev),  # committed tokens
            torch.zeros(B, dtype=torch.int32, device=dev),  # new tokens
            torch.zeros(B * Q * Q, dtype=torch.bool, device=dev),  # mask among the new tokens
            # output hidden states (and the aux layers' of a fused-feature head: set_aux_layers)
            torch.zeros(B * Q, cfg.hidden_size * (1 + len(self.model.aux_layers)), dtype=dtype, device=dev),
        )

    def _views(self, key) -> tuple[torch.Tensor, ...]:
        B, Q, L = key
        ids, pos, slots, tables, cached, new, mask, out = self._buffers
        return (ids[:B * Q], pos[:B * Q], slots[:B * Q], tables[:B * (L // self.block_size)].view(B, -1),
                cached[:B], new[:B], mask[:B * Q * Q].view(B, Q, Q), out[:B * Q])

    def _pool_handle(self):
        if self._pool is None:  # one memory pool for every graph: they never run concurrently
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def _capture(self, key):
        return record_graph(self._prepare(key), self.device, self._pool_handle())

    def _prepare(self, key):
        """The function a graph of `key` captures: the padded forward over the static views, its
        hidden states copied into the shared output buffer."""
        if self._buffers is None:
            self._allocate()
        views = self._views(key)
        # all padding: the warm-up and the capture itself write only the scratch block
        pad = pad_spans([], *key, self.block_size, self.scratch_block)
        for dst, src in zip(views, pad.tensors()):
            dst.copy_(src)

        def run():
            batch = expand_batch(*views[:-1], self.block_size)
            views[-1].copy_(self.model(batch, self.kv, self.backend))
        return run


def record_graph(run, device: torch.device, pool) -> torch.cuda.CUDAGraph:
    """Capture `run` (no host syncs inside) after one warm-up call on a side stream, as torch's
    CUDA graph docs ask (lazy initialisations, cuBLAS workspaces, allocator state)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        run()
    return graph
