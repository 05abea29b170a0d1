"""A CPU stand-in for the two flash-attn 2.8 functions the flash backend calls.

Same signatures (keyword names and defaults of flash_attn/flash_attn_interface.py, v2.8.x),
same output layouts and dtypes (out like q; softmax_lse float32, [B, H, Sq] from
`flash_attn_with_kvcache`, [H, total_q] from `flash_attn_varlen_func`), same argument checks as
the CUDA extension (int32 block tables / sequence lengths, page size % 256, contiguous last
dimension, fp16/bf16 only, head_dim <= 256, GQA head divisibility) and the same edge cases:
causal masks aligned to the bottom right, rows that see no key give output 0 and LSE +inf.
Arithmetic is a float64 softmax per sequence: slow and exact, for tests only.

Extensions, off by default: `allow_full_precision = True` lets float32/float64 through (the
real kernels refuse them) so tests can compare to the torch backend at float64 precision; then
float64 inputs get a float64 LSE. Features the engine does not use (appending k/v, rotary,
windows, softcap, ALiBi, dropout, left padding) raise NotImplementedError.

Install: `install(monkeypatch)` puts this module in sys.modules['flash_attn'], so the backend's
own `import flash_attn` finds it. `__standin__` tells make_backend it may run on the CPU.
"""
from __future__ import annotations

import sys
from collections import Counter

import torch

__version__ = "2.8.3+cpu-standin"
__standin__ = True
allow_full_precision = False
calls: Counter = Counter()  # function name -> number of calls, for tests to see which path ran

PAGE_MULTIPLE = 256


def install(monkeypatch, full_precision: bool = True):
    mod = sys.modules[__name__]
    monkeypatch.setitem(sys.modules, "flash_attn", mod)
    monkeypatch.setattr(mod, "allow_full_precision", full_precision)
    calls.clear()
    return mod


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)  # the extension's TORCH_CHECK raises RuntimeError


def _check_dtype(q, *others) -> None:
    allowed = (torch.float16, torch.bfloat16) + ((torch.float32, torch.float64) if allow_full_precision else ())
    _check(q.dtype in allowed, "FlashAttention only support fp16 and bf16 data type")
    for t in others:
        _check(t.dtype == q.dtype, "query and key must have the same dtype")


def _unsupported(**kwargs) -> None:
    for name, (value, default) in kwargs.items():
        if value is not None if default is None else value != default:
            raise NotImplementedError(f"flash_attn stand-in: {name}={value!r} is not implemented")


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """q [Sq, H, D], k, v [Sk, Hkv, D] -> out [Sq, H, D] float64, lse [H, Sq] float64."""
    sq, h, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    if sk == 0:
        return torch.zeros(sq, h, d, dtype=torch.float64), torch.full((h, sq), float("inf"), dtype=torch.float64)
    g = h // hkv
    kk = k.double().repeat_interleave(g, dim=1)  # query head i uses kv head i // g
    vv = v.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if causal:  # bottom-right aligned: query i sees keys j <= i + sk - sq
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        scores = scores.masked_fill(j > i + sk - sq, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, Sq]
    empty = lse == float("-inf")
    probs = torch.exp(scores - lse.masked_fill(empty, 0.0).unsqueeze(-1))
    out = torch.einsum("hqk,khd->qhd", probs, vv)
    return out, lse.masked_fill(empty, float("inf"))


def _paged_keys(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    page = cache.shape[1]
    pages = table_row[: -(-length // page)].long()
    return cache.index_select(0, pages).reshape(-1, *cache.shape[2:])[:length]


def _check_table(block_table, batch_size: int, cache: torch.Tensor) -> None:
    _check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
    _check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
    _check(block_table.dim() == 2 and block_table.shape[0] == batch_size, "block_table must be [batch, max_blocks]")
    _check(cache.dim() == 4 and cache.shape[1] % PAGE_MULTIPLE == 0,
           "Paged KV cache block size must be divisible by 256")


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    calls["flash_attn_with_kvcache"] += 1
    assert k_cache.stride(-1) == 1, "k_cache must have contiguous last dimension"
    assert v_cache.stride(-1) == 1, "v_cache must have contiguous last dimension"
    _unsupported(k=(k, None), v=(v, None), rotary_cos=(rotary_cos, None), rotary_sin=(rotary_sin, None),
                 cache_leftpad=(cache_leftpad, None), window_size=(tuple(window_size), (-1, -1)),
                 softcap=(softcap, 0.0), alibi_slopes=(alibi_slopes, None))
    _check_dtype(q, k_cache, v_cache)
    _check(q.dim() == 4, "q must be [batch, seqlen_q, nheads, headdim]")
    batch, sq, h, d = q.shape
    _check(batch > 0, "batch size must be positive")
    _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
    hkv = k_cache.shape[2]
    _check(h % hkv == 0, "Number of heads in key/value must divide number of heads in query")
    _check(k_cache.shape == v_cache.shape and k_cache.shape[3] == d, "k_cache / v_cache shape mismatch")
    paged = block_table is not None
    if paged:
        _check(cache_batch_idx is None, "Paged KVcache does not support cache_batch_idx")
        _check_table(block_table, batch, k_cache)
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is not None:
            _check(cache_batch_idx.dtype == torch.int32, "cache_batch_idx must have dtype int32")
        else:
            _check(k_cache.shape[0] == batch, "k_cache batch size must match q")
    if cache_seqlens is None:
        lens = [capacity] * batch
    elif isinstance(cache_seqlens, int):
        lens = [cache_seqlens] * batch
    else:
        _check(cache_seqlens.dtype == torch.int32, "seqlens_k must have dtype int32")
        _check(cache_seqlens.is_contiguous() and tuple(cache_seqlens.shape) == (batch,), "seqlens_k must be [batch]")
        lens = cache_seqlens.tolist()
    _check(max(lens) <= capacity and min(lens) >= 0, f"cache_seqlens {lens} out of range (capacity {capacity})")
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.empty(batch, sq, h, d, dtype=torch.float64)
    lse = torch.empty(batch, h, sq, dtype=torch.float64)
    for b in range(batch):
        if paged:
            keys, values = (_paged_keys(c, block_table[b], lens[b]) for c in (k_cache, v_cache))
        else:
            row = b if cache_batch_idx is None else int(cache_batch_idx[b])
            keys, values = k_cache[row, :lens[b]], v_cache[row, :lens[b]]
        out[b], lse[b] = _attend(q[b], keys, values, scale, causal and sq > 1)
    out = out.to(q.dtype)
    return (out, lse.to(_lse_dtype(q))) if return_softmax_lse else out


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    calls["flash_attn_varlen_func"] += 1
    _unsupported(dropout_p=(dropout_p, 0.0), window_size=(tuple(window_size), (-1, -1)), softcap=(softcap, 0.0),
                 alibi_slopes=(alibi_slopes, None))
    _check_dtype(q, k, v)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check(cu.dtype == torch.int32, f"{name} must have dtype int32")
        _check(cu.is_contiguous(), f"{name} must be contiguous")
    batch = cu_seqlens_q.numel() - 1
    _check(batch > 0, "batch size must be positive")
    _check(cu_seqlens_k.numel() == batch + 1, "cu_seqlens_k must be [batch + 1]")
    _check(q.dim() == 3, "q must be [total_q, nheads, headdim]")
    total_q, h, d = q.shape
    _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(d % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    paged = block_table is not None
    hkv = k.shape[2] if paged else k.shape[1]
    _check(h % hkv == 0, "Number of heads in key/value must divide number of heads in query")
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    q_lens = [cq[b + 1] - cq[b] for b in range(batch)]
    k_lens = [ck[b + 1] - ck[b] for b in range(batch)]
    _check(cq[0] == 0 and cq[-1] == total_q and min(q_lens) >= 0, "cu_seqlens_q does not cover q")
    # the kernels size their grid by max_seqlen_q: rows past it would never be written
    _check(max(q_lens) <= max_seqlen_q, f"max_seqlen_q {max_seqlen_q} < longest query run {max(q_lens)}")
    _check(max(k_lens) <= max_seqlen_k, f"max_seqlen_k {max_seqlen_k} < longest key run {max(k_lens)}")
    if paged:
        _check_table(block_table, batch, k)
        _check(max(k_lens) <= block_table.shape[1] * k.shape[1], "key run longer than its block table")
    else:
        _check(ck[0] == 0 and ck[-1] <= k.shape[0] and min(k_lens) >= 0, "cu_seqlens_k does not fit k")
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.empty(total_q, h, d, dtype=torch.float64)
    lse = torch.empty(h, total_q, dtype=torch.float64)
    for b in range(batch):
        if paged:
            keys, values = (_paged_keys(c, block_table[b], k_lens[b]) for c in (k, v))
        else:
            keys, values = k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
        out[cq[b]:cq[b + 1]], lse[:, cq[b]:cq[b + 1]] = _attend(q[cq[b]:cq[b + 1]], keys, values, scale,
                                                                causal and max_seqlen_q > 1)
    out = out.to(q.dtype)
    if return_attn_probs:  # S_dmask is only filled with dropout: an empty tensor here, as in the library
        return out, lse.to(_lse_dtype(q)), torch.empty((0,), dtype=q.dtype)
    return out
