"""Feature extraction: the target's final-norm hidden state of every token (and with aux layers
the residual stream after each of them), the regression target and input of the head, computed
once and cached in feature shards under OUT/cache."""
from __future__ import annotations

import hashlib
import os

import torch
from safetensors.torch import load_file, save_file

from eagle_serve.engine.attention import make_backend
from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch
from eagle_serve.engine.kv_cache import KVCache
from eagle_serve.engine.train.config import progress_bar
from eagle_serve.engine.train.data import DataError, Example


def extract_features(loaded, examples: list[Example], cache: str, key: str, log, progress: bool,
                     shard_size: int = 64, pack_tokens: int = 2048, aux_layers: tuple[int, ...] = ()) -> list[str]:
    """Target final-norm features of every token (and with aux_layers the residual stream after
    each of those layers, as `aux`), packed forwards of up to pack_tokens tokens,
    saved per shard of shard_size conversations. A shard's file is named by a hash of `key` (the
    target and its dtype) and its conversations' ids and masks, so a shard already computed -
    by an interrupted run, or by a run over fewer conversations - is reused as it is."""
    os.makedirs(cache, exist_ok=True)
    model, mcfg = loaded.model, loaded.config
    device = next(model.parameters()).device
    dtype = model.lm_head.weight.dtype
    block = 16
    shard_ranges = [(s, min(s + shard_size, len(examples))) for s in range(0, len(examples), shard_size)]
    shard_data, names = [], []
    for s, t in shard_ranges:
        ex = examples[s:t]
        data = {"ids": torch.tensor([i for e in ex for i in e.ids], dtype=torch.int32),
                "mask": torch.tensor([m for e in ex for m in e.mask], dtype=torch.uint8),
                "offsets": torch.tensor([0] + [len(e.ids) for e in ex]).cumsum(0)}
        shard_data.append(data)
        names.append(f"shard_{shard_hash(key, data['ids'], data['mask'], data['offsets'])}.safetensors")
    todo = [i for i, n in enumerate(names) if not os.path.exists(os.path.join(cache, n))]
    if todo:
        max_len = max(len(e.ids) for e in examples)
        n_blocks = (max(pack_tokens, max_len) + block - 1) // block + shard_size + 1
        kv = KVCache(mcfg.num_layers, n_blocks, block, mcfg.num_kv_heads, mcfg.head_dim, dtype, device)
        backend = make_backend(mcfg.head_dim ** -0.5, device, dtype)
        total = sum(len(e.ids) for i in todo for e in examples[slice(*shard_ranges[i])])
        log(f"features: {len(names) - len(todo)} of {len(names)} shards cached, computing {total} tokens")
        bar = progress_bar(total, "features", progress)
    for si in todo:
        s, t = shard_ranges[si]
        feats, auxs = [], []
        group: list[Example] = []

        def flush():
            spans, b0 = [], 0
            for e in group:
                nb = (len(e.ids) + block - 1) // block
                spans.append(SeqSpan(e.ids, 0, list(range(b0, b0 + nb))))
                b0 += nb
            with torch.inference_mode():
                batch = build_forward_batch(spans, block, device)
                if aux_layers:
                    hidden, aux = model.forward_aux(batch, kv, backend, aux_layers)
                    auxs.append(aux.to(torch.bfloat16).cpu())
                else:
                    hidden = model(batch, kv, backend)
            feats.append(hidden.to(torch.bfloat16).cpu())
            bar.update(sum(len(e.ids) for e in group))
            group.clear()

        for e in examples[s:t]:
            if group and sum(len(g.ids) for g in group) + len(e.ids) > pack_tokens:
                flush()
            group.append(e)
        if group:
            flush()
        tmp = os.path.join(cache, names[si] + ".part")
        save_file({**shard_data[si], "feats": torch.cat(feats), **({"aux": torch.cat(auxs)} if auxs else {})}, tmp)
        os.replace(tmp, os.path.join(cache, names[si]))
    if todo:
        bar.close()
    return [os.path.join(cache, n) for n in names]


def shard_hash(key: str, ids: torch.Tensor, mask: torch.Tensor, offsets: torch.Tensor) -> str:
    """What a feature shard depends on: the target (key) and its conversations' ids and masks."""
    h = hashlib.sha256(key.encode())
    for t in (ids.to(torch.int32), mask.to(torch.uint8), offsets.to(torch.int64)):
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:20]


def load_shards(paths: list[str]):
    """(ids, masks, feats, offsets, aux or None) of the shards, concatenated."""
    ids, masks, feats, auxs, offsets = [], [], [], [], [torch.zeros(1, dtype=torch.int64)]
    for p in paths:
        d = load_file(p)
        ids.append(d["ids"].long())
        masks.append(d["mask"].bool())
        feats.append(d["feats"])
        if "aux" in d:
            auxs.append(d["aux"])
        offsets.append(d["offsets"][1:] + offsets[-1][-1])
    if auxs and len(auxs) != len(paths):
        raise DataError("some feature shards have the aux layers' features and some do not")
    aux = torch.cat(auxs) if auxs else None
    return torch.cat(ids), torch.cat(masks), torch.cat(feats), torch.cat(offsets), aux
