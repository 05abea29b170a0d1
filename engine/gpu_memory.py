"""KV cache sizing on CUDA: what is left of `gpu_memory_utilization` x the GPU's memory once the
weights, the activations of the largest step and the CUDA graphs' pool are accounted for.

    kv bytes = total x utilization - (in use after the weights and a profiling forward) - graph reserve

"In use" is the peak of torch's allocator during one forward of `max_num_batched_tokens` tokens
(the largest step the scheduler can build, laid out as prefill chunks of `max_prefill_chunk`
tokens, with the LM head over as many rows as the largest verify step samples) plus what is
used outside torch's allocator (CUDA context, cuBLAS workspaces, other processes). The
profiling forward uses the torch attention backend, the most memory-hungry one, so the
estimate errs towards a smaller cache. The arithmetic is in pure functions (`kv_cache_bytes`,
`kv_cache_blocks`, `graph_reserve_bytes`), tested on the CPU with made-up numbers.
"""
from __future__ import annotations

import torch

from eagle_serve.engine.attention import TorchAttention
from eagle_serve.engine.cuda_graphs import default_buckets, graphs_enabled
from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch
from eagle_serve.engine.kv_cache import KVCache
from eagle_serve.engine.speculative.eagle3_config import eagle3_state_count
from eagle_serve.engine.speculative.eagle_drafter import feature_width
from eagle_serve.engine.speculative.eagle_head import head_aux_layers


GIB = 1 << 30


def _gib(x: float) -> str:
    return f"{x / GIB:.2f} GiB"


def kv_cache_bytes(total: int, in_use: int, utilization: float, reserve: int = 0) -> int:
    """Bytes the KV cache may take; a ValueError saying what to change when nothing is left."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    allowed = int(total * utilization)
    budget = allowed - in_use - reserve
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: gpu_memory_utilization {utilization} of {_gib(total)} allows "
            f"{_gib(allowed)}, but the weights and the largest step's activations already use {_gib(in_use)}"
            f"{f' and the CUDA graphs reserve {_gib(reserve)}' if reserve else ''}; raise "
            f"--gpu-memory-utilization, lower --max-num-batched-tokens / --max-num-seqs, pass --no-cuda-graphs, "
            f"or use a smaller model or dtype")
    return budget


def kv_cache_blocks(budget: int, bytes_per_token: int, block_size: int) -> int:
    """Whole blocks that fit in `budget` bytes (at least one, else a ValueError)."""
    per_block = bytes_per_token * block_size
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(f"the KV cache budget {_gib(budget)} does not hold one block ({per_block} bytes: "
                         f"{block_size} tokens x {bytes_per_token} bytes); raise --gpu-memory-utilization")
    return blocks


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, element_size: int,
                       draft_layers: int = 0, draft_feature_width: int = 0) -> int:
    """K and V of every target layer, plus the EAGLE head's own one-layer cache when it drafts
    (it has as many blocks as the target's and, as every EAGLE head, the target's KV shape) and
    its feature cache (`draft_feature_width` values a slot: engine.speculative.eagle_drafter)."""
    return (2 * (num_layers + draft_layers) * num_kv_heads * head_dim + draft_feature_width) * element_size


def draft_feature_width(config, hidden_size: int) -> int:
    """The feature cache's width for an engine config's EAGLE head (0 without one): the target's
    hidden size, times 1 + the head's fused layers (its config.json's aux_layers, or the hidden
    states an EAGLE-3 head reads)."""
    if not (config.spec.uses_head and config.draft):
        return 0
    return feature_width(hidden_size, head_aux_layers(config.draft) or range(eagle3_state_count(config.draft)))


def engine_kv_bytes_per_token(config, model, dtype: torch.dtype) -> int:
    """What one KV token costs an engine (EngineConfig `config`, the target's ModelConfig
    `model`): the target's KV, and the EAGLE head's KV and feature cache where it drafts."""
    return kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, dtype.itemsize,
                              draft_layers=1 if config.spec.uses_head and config.draft else 0,
                              draft_feature_width=draft_feature_width(config, model.hidden_size))


def graph_reserve_bytes(batch: int, tokens: int, kv_len: int, num_heads: int, num_kv_heads: int,
                        head_dim: int, hidden: int, intermediate: int, element_size: int) -> int:
    """Upper estimate of the CUDA graph pool: the intermediates of the largest bucket's forward
    (one layer's gathered keys and values, its mask and attention scores, the MLP's activations
    and the residual stream; layers run one after another, so one layer's worth)."""
    t = batch * tokens
    gathered = 2 * batch * kv_len * num_kv_heads * head_dim * element_size
    scores = batch * num_heads * tokens * kv_len * 4  # float32 scores if SDPA falls back to its math kernel
    mask = batch * (num_heads // num_kv_heads) * tokens * kv_len
    mlp = t * 3 * intermediate * element_size
    stream = t * 6 * max(hidden, num_heads * head_dim) * element_size
    return gathered + scores + mask + mlp + stream


def profile_in_use(runner) -> tuple[int, int]:
    """(total device bytes, bytes in use) after the weights and one profiling forward of the
    largest step (module doc). Runs before the KV cache exists, with a temporary one."""

    c, m, dev = runner.config, runner.loaded.config, runner.device
    bs = c.block_size
    chunk = min(c.max_prefill_chunk, c.max_num_batched_tokens)
    n_seqs = max(1, min(c.max_num_seqs, -(-c.max_num_batched_tokens // chunk)))
    per_seq_blocks = -(-chunk // bs)
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    kv = KVCache(m.num_layers, n_seqs * per_seq_blocks, bs, m.num_kv_heads, m.head_dim, runner.dtype, dev)
    kv_bytes = kv.data.numel() * kv.data.element_size()
    left, spans = c.max_num_batched_tokens, []
    for b in range(n_seqs):
        n = min(chunk, left)
        left -= n
        if n > 0:
            spans.append(SeqSpan([0] * n, 0, list(range(b * per_seq_blocks, (b + 1) * per_seq_blocks))))
    rows = min(c.max_num_batched_tokens, c.max_num_seqs * c.spec.tree_tokens)
    with torch.inference_mode():
        hidden = runner.model(build_forward_batch(spans, bs, dev), kv, TorchAttention(m.head_dim ** -0.5))
        idx = torch.arange(rows, device=dev) % hidden.shape[0]
        runner.model.compute_logits(hidden[idx]).argmax(-1)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - kv_bytes
    del kv, hidden
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    outside_torch = max(0, (total - free) - torch.cuda.memory_reserved(dev))
    return total, peak + outside_torch


def cuda_kv_cache_tokens(runner) -> int:
    """KV tokens for a CUDA runner with `kv_cache_tokens` None (whole blocks' worth)."""

    c, m = runner.config, runner.loaded.config
    elt = runner.dtype.itemsize
    per_token = engine_kv_bytes_per_token(c, m, runner.dtype)
    total, in_use = profile_in_use(runner)
    reserve = 0
    if graphs_enabled(runner.device, c.cuda_graphs):  # the largest capturable bucket's intermediates
        b = default_buckets(c.max_num_seqs, c.spec.tree_tokens, (c.max_model_len or m.max_model_len) + c.spec.scratch_slots,
                            c.block_size, c.cuda_graph_batch_sizes, c.cuda_graph_token_sizes)
        reserve = max((graph_reserve_bytes(batch, max(b.tokens), kv_len, m.num_heads, m.num_kv_heads, m.head_dim,
                                           m.hidden_size, m.intermediate_size, elt)
                       for batch in b.batch for kv_len in b.kv
                       if b.max_keys is None or batch * kv_len <= b.max_keys), default=0)
    budget = kv_cache_bytes(total, in_use, c.gpu_memory_utilization, reserve)
    return kv_cache_blocks(budget, per_token, c.block_size) * c.block_size
