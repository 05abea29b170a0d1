"""The reference side of bench/eagle3_interop.py: runs in a separate environment that holds
SpecForge's and speculators' EAGLE-3 model code (not eagle-serve), one job per call.

    python _eagle3_ref_worker.py JOB.json

Jobs (JSON): {"op": "build" | "load", "layout": "specforge" | "speculators", "dir": head
directory, "inputs": safetensors with ids [T], aux [T, n H] and embed [V, H], "out": safetensors
for the reference's logits, "result": JSON report}; "build" also takes "sizes", "seed",
"aux_ids", "norm_before_residual", "draft_vocab_ids" (the target ids of the draft vocabulary).

build: a random head with the reference's own classes, saved with its save_pretrained, then
its draft logits over the inputs. load: the reference's from_pretrained of a head directory
(its loading info: missing, unexpected and mismatched keys), then the logits.
"""
from __future__ import annotations

import json
import os
import sys
import types
from importlib import metadata

# the references' RMSNorm and RoPE functions are wrapped in torch.compile: run them eagerly
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

# speculators' package import reaches its training-data modules (speculators.train.data), which
# import these at module level; the EAGLE-3 model code itself uses none of them
STUBBED = ("openai", "openai.types", "openai.types.chat", "openai.types.completion", "datasets", "hs_connectors")


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


def _stub_missing() -> list[str]:
    done = []
    for name in STUBBED:
        try:
            __import__(name)
        except ImportError:
            mod = _Stub(name)
            mod.__path__ = []
            sys.modules[name] = mod
            done.append(name)
    return done


def _perturb(model: torch.nn.Module, seed: int, std: float) -> None:
    """Random weights: N(0, std) for matrices, 1 + N(0, 0.1) for norms (a norm left at one
    would hide a norm applied to the wrong tensor)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(1 + 0.1 * noise if p.dim() == 1 else std * noise)


def _vocab(ids: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(t2d, d2t) buffers: t2d marks the target ids, d2t holds offsets (target = i + d2t[i])."""
    used = torch.tensor(sorted(ids), dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    return t2d, used - torch.arange(len(used))


# ---- SpecForge --------------------------------------------------------------------------------

def specforge_build(job, inputs):
    from transformers import LlamaConfig

    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    s = job["sizes"]
    cfg = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], head_dim=s["hidden"] // s["heads"], num_hidden_layers=1,
                      vocab_size=s["vocab"], rms_norm_eps=s["eps"], max_position_embeddings=s["max_positions"],
                      rope_theta=s["rope_theta"], hidden_act="silu", tie_word_embeddings=False,
                      architectures=["LlamaForCausalLMEagle3"])
    cfg.draft_vocab_size = s["draft_vocab"]
    cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": job["aux_ids"]}
    model = LlamaForCausalLMEagle3(cfg, attention_backend="sdpa").float()
    _perturb(model, job["seed"], job.get("std", 0.1))
    t2d, d2t = _vocab(job["draft_vocab_ids"], s["vocab"])
    with torch.no_grad():
        model.embed_tokens.weight.copy_(inputs["embed"])
        model.t2d.copy_(t2d)
        model.d2t.copy_(d2t)
    # SpecForge's HF export (specforge.export.to_hf): save_pretrained of the full state, the
    # target's embedding included
    model.save_pretrained(job["dir"])
    return model, {}


def specforge_load(job):
    """SpecForge's AutoDraftModel.from_pretrained. Under transformers 5 it builds the model on
    the meta device, so the RoPE tables SpecForge's attention computes in its constructor
    (non-persistent buffers inv_freq, cos_cached, sin_cached) come back uninitialized, for the
    heads SpecForge saves itself as for any other: the attention's own _init_rope rebuilds them."""
    from specforge.modeling.auto import AutoDraftModel
    model, info = AutoDraftModel.from_pretrained(job["dir"], output_loading_info=True, dtype=torch.float32)
    attn = model.midlayer.self_attn
    loaded = attn.rotary_emb.cos_cached.clone()
    attn._init_rope()
    fresh = attn.rotary_emb.cos_cached
    info["rope_tables_rebuilt"] = True
    info["rope_tables_as_loaded_were_wrong"] = bool(loaded.shape != fresh.shape or not torch.equal(loaded, fresh))
    return model.float(), info


def specforge_logits(model, inputs):
    """SpecForge's own inference step (specforge.algorithms.eagle3.model, one TTT step):
    embed_input_ids, project_hidden_states, the causal decoder mask, backbone, compute_logits."""
    ids, aux = inputs["ids"][None], inputs["aux"][None]
    T = ids.shape[1]
    x = model.project_hidden_states(aux)
    mask = model.prepare_decoder_attention_mask(torch.ones(1, T, dtype=torch.bool), x, 1, T, 0)
    z = model.backbone(model.embed_input_ids(ids).to(x.dtype), x, None, mask, torch.arange(T)[None])
    return model.compute_logits(z)[0], model.d2t


# ---- speculators ------------------------------------------------------------------------------

def speculators_build(job, inputs):
    from transformers import LlamaConfig

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    s = job["sizes"]
    layer = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_attention_heads=s["heads"],
                        num_key_value_heads=s["kv_heads"], head_dim=s["hidden"] // s["heads"], num_hidden_layers=1,
                        vocab_size=s["vocab"], rms_norm_eps=s["eps"], max_position_embeddings=s["max_positions"],
                        rope_theta=s["rope_theta"], hidden_act="silu", tie_word_embeddings=False)
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=s["draft_vocab"],
        norm_before_residual=job["norm_before_residual"], eagle_aux_hidden_state_layer_ids=job["aux_ids"],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    model = Eagle3DraftModel(cfg).float()
    _perturb(model, job["seed"], job.get("std", 0.1))
    t2d, d2t = _vocab(job["draft_vocab_ids"], s["vocab"])
    model.load_vocab_mappings(t2d, d2t)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(inputs["embed"])
    model.save_pretrained(job["dir"])
    return model, {}


def speculators_load(job):
    """speculators' own entry point (SpeculatorModel.from_pretrained, which has no
    output_loading_info: it reads the returned model's config); the loading info from the
    Hugging Face from_pretrained it wraps, on the same class and config."""
    from speculators.model import SpeculatorModel
    model = SpeculatorModel.from_pretrained(job["dir"])
    _, info = super(SpeculatorModel, type(model)).from_pretrained(job["dir"], config=model.config,
                                                                   output_loading_info=True)
    return model.float(), info


def speculators_logits(model, inputs):
    """speculators' Eagle3DraftModel.forward, one TTT step from position 0, its lm_head output
    taken by a hook (the forward returns the argmax tokens only)."""
    ids, aux = inputs["ids"][None], inputs["aux"][None]
    T = ids.shape[1]
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: seen.append(out))
    try:
        model(aux, ids, torch.zeros(1, T, dtype=torch.long), position_ids=torch.arange(T)[None], ttt_steps=1)
    finally:
        hook.remove()
    return seen[0][0], model.d2t


# ---- driver -----------------------------------------------------------------------------------

OPS = {("specforge", "build"): specforge_build, ("specforge", "load"): specforge_load,
       ("speculators", "build"): speculators_build, ("speculators", "load"): speculators_load}
LOGITS = {"specforge": specforge_logits, "speculators": speculators_logits}
PACKAGES = {"specforge": "specforge", "speculators": "speculators"}


def main(job_file: str) -> None:
    with open(job_file, encoding="utf-8") as f:
        job = json.load(f)
    stubbed = _stub_missing()
    torch.manual_seed(job.get("seed", 0))
    inputs = load_file(job["inputs"])
    layout, op = job["layout"], job["op"]
    if op == "build":
        model, info = OPS[layout, op](job, inputs)
    else:
        model, info = OPS[layout, op](job)
    model.eval()
    with torch.no_grad():
        logits, d2t = LOGITS[layout](model, inputs)
    logits = logits.float()
    top = logits.argmax(-1)
    top_ids = top if d2t is None else top + d2t[top]
    save_file({"logits": logits.contiguous(), "top1": top_ids.long().contiguous()}, job["out"])
    weights = load_file(os.path.join(job["dir"], "model.safetensors"))
    result = {
        "reference": {PACKAGES[layout]: metadata.version(PACKAGES[layout]), "transformers": metadata.version(
            "transformers"), "torch": torch.__version__.split("+")[0]},
        "stubbed_modules": stubbed,
        "class": type(model).__name__,
        "file_keys": sorted(weights),
        "model_keys": sorted(model.state_dict()),
        "loading_info": {k: sorted(map(str, v)) for k, v in info.items() if k in (
            "missing_keys", "unexpected_keys", "mismatched_keys")},
    }
    for key in ("rope_tables_rebuilt", "rope_tables_as_loaded_were_wrong"):
        if key in info:
            result[key] = info[key]
    if layout == "speculators":
        result["attn_implementation"] = model.config.transformer_layer_config._attn_implementation
        result["keys_not_saved"] = sorted(getattr(model, "_keys_to_ignore_on_save", None) or [])
        result["keys_optional_on_load"] = sorted(getattr(model, "_keys_to_ignore_on_load_missing", None) or [])
    with open(job["result"], "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
