"""EAGLE-1/2 draft head: fc over [token embedding ; target feature], one Llama decoder layer
without an input norm, and the target's own embedding and LM head.

The feature is the target's last hidden state *after* its final RMSNorm, i.e. the input of the
LM head: the EAGLE reference takes `outputs[0]` of its Llama model, whose forward ends with
`self.norm`. The head's output feature goes to the LM head directly (no norm of its own).
Published layout: config.json of a one-layer Llama (optional `bias`, default true), weights
`fc.weight` [h, 2h] (+ `fc.bias`), `layers.0.self_attn.{q,k,v,o}_proj.weight`,
`layers.0.mlp.{gate,up,down}_proj.weight`, `layers.0.post_attention_layernorm.weight`, in
model.safetensors or pytorch_model.bin; a stray `embed_tokens.weight` must equal the target's.
A reduced draft vocabulary (`draft_vocab_size` K in config.json, `d2t` [K] = the target id of each
draft index, as `eagle-serve train-draft --draft-vocab K` writes it) makes the draft's LM head
the K matching rows of the target's: drafting ranks K tokens instead of the whole vocabulary.
Fused features (`aux_layers` [l_1, ...] in config.json, `fc_aux.weight` [h, n h], as
`train-draft --aux-layers` writes them; EAGLE-3's idea on the EAGLE-2 head): where the target's
features of a position are known, the head's input feature is f + fc_aux([rms(a_1) ; ...]), a_i
being the target's residual stream after layer l_i, each RMS-normalised without a weight; the
target then hands the drafter [f ; a_1 ; ...] per token. Deeper draft levels feed the head's own
predicted features as before.
"""
from __future__ import annotations

import json
import os

import torch
from torch import nn

from eagle_serve.engine import kernels, quant
from eagle_serve.engine.attention import AttentionBackend
from eagle_serve.engine.forward_batch import ForwardBatch
from eagle_serve.engine.kv_cache import KVCache
from eagle_serve.engine.layers import FAST_DTYPES, INT8_MAX_ROWS, W8A8_MAX_ROWS, Linear, weights_to_arena
from eagle_serve.engine.loader import ModelLoadError, fill_parameters, read_json
from eagle_serve.engine.model_config import ModelConfig
from eagle_serve.engine.models.llama import DecoderLayer, LlamaForCausalLM, native_stack, native_stack_forward


def topk_log_probs(logits: torch.Tensor, k: int, d2t: torch.Tensor | None):
    """(log-probs, token ids) of the k best entries of each row of logits, ids mapped through d2t
    (a draft vocabulary's target ids) where given: float32 on the CPU in one native call, else
    log_softmax and topk."""
    k = min(k, logits.shape[-1])
    fn = (getattr(kernels.native(), "topk_log_softmax", None)
          if logits.device.type == "cpu" and logits.dtype == torch.float32 else None)
    if fn is not None:
        return tuple(fn(logits.contiguous(), k, d2t if d2t is not None else _NONE))
    top = logits.log_softmax(-1).topk(k)
    return top.values, top.indices if d2t is None else d2t[top.indices]


class EagleHead(nn.Module):
    rotary = None  # the head uses the target's RoPE (or one built from its config: EagleDrafter)
    embed_tokens = None  # and the target's token embedding

    def __init__(self, cfg: ModelConfig, bias: bool, aux_layers: tuple[int, ...] = ()):
        super().__init__()
        self.config = cfg
        self.aux_layers = tuple(aux_layers)
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=bias)
        self.fc_aux = Linear(len(aux_layers) * cfg.hidden_size, cfg.hidden_size) if aux_layers else None
        self.layer = DecoderLayer(cfg, 0)
        self.layer.input_layernorm = nn.Identity()  # EAGLE's layer 0 has no input norm
        self.d2t: torch.Tensor | None = None  # [K] target ids of a reduced draft vocabulary
        self.lm_head: Linear | None = None  # the target's rows for d2t
        self._stack = None  # the layer as a native DecodeStack, set by prepack() where available
        self._stack_max_rows = 0

    def set_draft_vocab(self, d2t: torch.Tensor, target: LlamaForCausalLM) -> None:
        w = quant.dense_weight(target.lm_head)  # (dequantized rows where the target's are GGUF blocks)
        self.d2t = d2t.to(device=w.device, dtype=torch.long)
        self.lm_head = Linear(w.shape[1], len(d2t))
        self.lm_head.weight.data = w[self.d2t].contiguous()

    def draft_topk(self, hidden: torch.Tensor, target: LlamaForCausalLM, k: int):
        """(log-probs, target token ids) of the k most likely draft tokens per row: float32 logits
        on the CPU in one native call (kernels' topk_log_softmax, the ranking head_level's
        native path does, so the two paths agree), else log_softmax and topk."""
        if self.lm_head is None:
            return topk_log_probs(target.compute_logits(hidden), k, None)
        return topk_log_probs(self.lm_head(hidden, float_out=True).float(), k, self.d2t)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, batch: ForwardBatch,
                kv: KVCache, backend: AttentionBackend, rotary) -> torch.Tensor:
        """embeds [T, h], features [T, h] (or [T, (1 + n) h]: the target's [f ; aux], fused
        here) -> predicted next features [T, h]."""
        h = self.config.hidden_size
        if features.shape[-1] not in (h, h * (1 + len(self.aux_layers))):
            raise ValueError(f"draft head features of width {features.shape[-1]}: expected {h}"
                             + (f" or {h * (1 + len(self.aux_layers))} (fused layers {list(self.aux_layers)})"
                                if self.aux_layers else ""))
        if features.shape[-1] > h:
            features = features[:, :h] + self.fc_aux(aux_norm(features[:, h:], len(self.aux_layers),
                                                              self.config.rms_norm_eps))
        x = self.fc(torch.cat([embeds, features], dim=-1))
        if self._stack is not None and x.shape[0] <= self._stack_max_rows and backend.name == "native":
            # one native call instead of ~15 Python-level ops (bench/bench_draft_calls.py)
            return native_stack_forward(self._stack, x, batch, kv, rotary)
        batch.cos, batch.sin = rotary.lookup(batch.positions, x.dtype)
        h, residual = self.layer(x, None, batch, kv, backend)
        return h + residual

    def level(self, batch: ForwardBatch, embed: nn.Embedding, features: torch.Tensor, kv: KVCache,
              backend: AttentionBackend, rotary, k: int, top_rows: torch.Tensor | None = None):
        """One draft level in one native call (DecodeStack.head_level): forward() over the batch,
        then draft_topk() of the rows `top_rows` (None: all), with the same kernels and ops, so
        the same numbers. Returns (hidden, its top rows, log-probs, target ids) as tensors, or
        None where the Python path must run: no native stack (or more rows than it takes), a
        linear that would not run natively at these rows, or the full-vocabulary draft."""
        T = features.shape[0]
        R = T if top_rows is None else top_rows.shape[0]
        if (self._stack is None or T > self._stack_max_rows or backend.name != "native" or self.lm_head is None
                or not hasattr(self._stack, "head_level")):  # (a kernel module built before it)
            return None
        h = self.config.hidden_size
        # the target's [f ; aux] (the first level of a fused-feature head) or a feature of width h
        # (a plain head, and every deeper level: the head's own predictions)
        n_aux = len(self.aux_layers) if self.aux_layers and features.shape[-1] == h * (1 + len(self.aux_layers)) else 0
        if features.shape[-1] != h * (1 + n_aux):
            return None  # forward() reports the width
        fc, lm = self.fc.native_for(T), self.lm_head.native_for(R)
        aux = self.fc_aux.native_for(T) if n_aux else _NONE
        if fc is None or lm is None or aux is None or embed.weight.dtype != features.dtype:
            return None
        none = _NONE
        return self._stack.head_level(
            batch.input_ids, features.contiguous(), embed.weight, fc, self.fc.bias if self.fc.bias is not None else none,
            aux, n_aux, lm, self.d2t if self.d2t is not None else none,
            top_rows if top_rows is not None else none, k, kv.data, batch.slot_mapping,
            batch.kv_gather.view(batch.num_seqs, -1), batch.kv_lens, batch.q_seq, batch.q_row, batch.mask_3d(),
            rotary.cos_table, rotary.sin_table, batch.positions)

    def native_rows(self, backend: AttentionBackend) -> int:
        """The most rows one native forward of the head takes here (its stack, fc and fused-feature
        projection natively), or 0 where it does not run."""
        rows = self._stack_max_rows
        if (self._stack is None or backend.name != "native" or rows < 1 or self.fc.native_for(rows) is None
                or (self.fc_aux is not None and self.fc_aux.native_for(rows) is None)):
            return 0
        return rows

    def tree_runs(self, rows: int, backend: AttentionBackend, embed: nn.Embedding, dtype: torch.dtype) -> bool:
        """Whether `tree` runs a draft whose levels have at most `rows` rows: the native head
        stack takes them (native_rows), the draft LM head is a reduced vocabulary's and takes them
        natively, and the embeddings and features share a dtype."""
        return (rows <= self.native_rows(backend) and self.lm_head is not None
                and self.lm_head.native_for(rows) is not None and embed.weight.dtype == dtype
                and hasattr(self._stack, "draft_tree"))  # (a kernel module built before it)

    def tree(self, pending: list[list[int]], draft_len: list[int], tables: list[list[int]], max_depths: list[int],
             features: torch.Tensor, embed: nn.Embedding, kv: KVCache, rotary, width: int, top_k: int,
             block_size: int):
        """A round's whole EAGLE-2 draft in one native call (DecodeStack.draft_tree), where
        tree_runs said it runs: (tokens, parents, scores, depths, counts) tensors."""
        lins = (self.fc, self.fc_aux, self.lm_head)
        return self._stack.draft_tree(
            pending, draft_len, tables, max_depths, features, len(self.aux_layers), embed.weight,
            [m.native_weight if m is not None else _NONE for m in lins],
            [m.int8_weight if m is not None and m.int8_weight is not None else _NONE for m in lins],
            [m.int8_max_rows if m is not None else 0 for m in lins],
            self.fc.bias if self.fc.bias is not None else _NONE, self.d2t if self.d2t is not None else _NONE,
            width, top_k, block_size, kv.data, rotary.cos_table, rotary.sin_table)

    def prepack(self, native: bool = True, int8: bool = False, int8_inputs: bool = False) -> int:
        """Prepack every linear; with the native kernels, the layer becomes a one-layer DecodeStack
        (no input norm, no final norm) for batches of up to as many rows as its linears take.
        int8: the linears also keep int8 weights (Linear.quantize_int8) for inputs of up to
        INT8_MAX_ROWS rows, the stack's among them, int8_inputs: rounding those inputs to 8 bits
        too (VNNI), for up to W8A8_MAX_ROWS rows; returns the linears prepacked."""
        packed = prepack_head_linears(self, native, int8, int8_inputs)
        weights_to_arena([m for m in self.modules() if isinstance(m, Linear)])
        self._stack, self._stack_max_rows = native_stack([self.layer], None, self.config, self.fc.weight.dtype, native)
        return packed


_NONE = torch.empty(0)  # an absent tensor argument of the native calls


def aux_norm(aux: torch.Tensor, n: int, eps: float) -> torch.Tensor:
    """[..., n h] -> each of the n chunks RMS-normalised (statistics in float32 at least), no
    weight; the training module (engine.train.head) uses it too. On the CPU in bfloat16 /
    float32, without autograd, one native call instead of the torch expression's ~10 ops."""
    if aux.device.type == "cpu" and aux.dtype in FAST_DTYPES and aux.dim() == 2 \
            and not (aux.requires_grad and torch.is_grad_enabled()):
        # the kernel rounds once to aux's dtype; the expression below rounds the scale to it
        # first, so in bfloat16 the two can differ by an ulp
        fn = getattr(kernels.native(), "rms_norm_chunks", None)  # (a module built before it: None)
        if fn is not None:
            return fn(aux.contiguous(), n, eps)
    a = aux.reshape(*aux.shape[:-1], n, aux.shape[-1] // n)
    acc = torch.promote_types(a.dtype, torch.float32)
    a = a * torch.rsqrt(a.to(acc).pow(2).mean(-1, keepdim=True) + eps).to(a.dtype)
    return a.reshape(aux.shape)


def prepack_head_linears(head: nn.Module, native: bool, int8: bool, int8_inputs: bool) -> int:
    """Prepack a draft head's linears, each bucketing its row counts (one product a forward each:
    a new row count's kernels cost more than padding), and with int8 keep int8 weights for inputs
    of up to INT8_MAX_ROWS rows (W8A8_MAX_ROWS with int8_inputs: inputs rounded to 8 bits too);
    returns the linears prepacked."""
    linears = [m for m in head.modules() if isinstance(m, Linear)]
    packed = sum(m.prepack(native) for m in linears)
    for m in linears:
        m.bucket_rows = True
        if native and int8:
            m.quantize_int8(W8A8_MAX_ROWS if int8_inputs else INT8_MAX_ROWS, int8_inputs)
    return packed


def check_draft_ids(ids: torch.Tensor, vocab: int, path: str) -> None:
    """A draft vocabulary's target ids must be distinct and within the target's vocabulary."""
    if int(ids.min()) < 0 or int(ids.max()) >= vocab or len(torch.unique(ids)) != len(ids):
        raise ModelLoadError(f"draft head {path!r}: d2t must map to distinct target ids below {vocab}")


def shares_target_rotary(cfg: ModelConfig, target: ModelConfig) -> bool:
    """Whether a head's positions are rotated with the target's own rotary embedding (its
    scaling and table included): a head with the target's rope_theta and head_dim, as published
    heads are (their configs often leave the target's rope scaling out). Training and serving
    both follow this rule."""
    return cfg.rope_theta == target.rope_theta and cfg.head_dim == target.head_dim


def head_aux_layers(path: str) -> list[int]:
    """The target layers a head directory fuses (config.json `aux_layers`; [] for a plain head,
    and for a missing or broken config, which `load_eagle_head` reports clearly)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            aux = json.load(f).get("aux_layers") or []
    except (OSError, ValueError, AttributeError):
        return []
    return list(aux) if isinstance(aux, list) else []


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "model.safetensors")
    if os.path.exists(st):
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(st)
        except SafetensorError as e:
            raise ModelLoadError(f"{st}: not a readable safetensors file ({e})") from None
    pt = os.path.join(path, "pytorch_model.bin")
    if os.path.exists(pt):
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise ModelLoadError(f"{path}: no model.safetensors or pytorch_model.bin for the draft head")


def load_eagle_head(path: str, target: LlamaForCausalLM, dtype: torch.dtype) -> EagleHead:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise ModelLoadError(f"draft head {path!r}: missing config.json")
    raw = read_json(cfg_file)
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{cfg_file}: not a JSON object")
    raw = {**raw, "num_hidden_layers": 1}
    raw.setdefault("architectures", ["LlamaForCausalLM"])
    cfg = ModelConfig.from_hf(raw, cfg_file)
    t = target.config
    if (cfg.hidden_size, cfg.vocab_size) != (t.hidden_size, t.vocab_size):
        raise ModelLoadError(f"draft head {path!r} (hidden {cfg.hidden_size}, vocab {cfg.vocab_size}) does "
                             f"not fit the target (hidden {t.hidden_size}, vocab {t.vocab_size})")
    weights = _read_weights(path)
    d2t = weights.pop("d2t", None)
    aux = raw.get("aux_layers") or []
    if not isinstance(aux, list) or not all(isinstance(i, int) and 0 <= i < t.num_layers - 1 for i in aux) \
            or len(set(aux)) != len(aux):
        raise ModelLoadError(f"draft head {path!r}: aux_layers {aux!r} must be distinct layers of the target "
                             f"below its last ({t.num_layers - 1})")
    if bool(aux) != ("fc_aux.weight" in weights):
        raise ModelLoadError(f"draft head {path!r}: config aux_layers {aux} does not match its weights "
                             f"({'no ' if 'fc_aux.weight' not in weights else ''}fc_aux.weight)")
    head = EagleHead(cfg, bias="fc.bias" in weights, aux_layers=tuple(aux))
    _load(head, weights, target, dtype, path)
    k = raw.get("draft_vocab_size")
    if (d2t is None) != (k is None) or (d2t is not None and (d2t.dim() != 1 or len(d2t) != k)):
        raise ModelLoadError(f"draft head {path!r}: config draft_vocab_size {k} does not match its d2t "
                             f"tensor ({None if d2t is None else list(d2t.shape)})")
    if d2t is not None:
        check_draft_ids(d2t, t.vocab_size, path)
        head.set_draft_vocab(d2t, target)
    return head.eval()


def _load(head: EagleHead, weights: dict, target: LlamaForCausalLM, dtype: torch.dtype, path: str) -> None:
    def renamed():
        for name, w in weights.items():
            if name.endswith("embed_tokens.weight"):  # tolerated if it is the target's own
                if not torch.equal(w.to(dtype), quant.dense_weight(target.model.embed_tokens).to(dtype)):
                    raise ModelLoadError(f"draft head {path!r}: its embed_tokens differ from the target's")
                continue
            yield name.removeprefix("model.").replace("layers.0.", "layer."), w
    fill_parameters(head, renamed(), dtype, f"draft head {path!r}")
