#!/usr/bin/env python
"""EAGLE-3 interoperability, measured against the reference implementations on PyPI.

For each layout a reference writes (SpecForge's `LlamaForCausalLMEagle3`, speculators'
`Eagle3DraftModel`, the latter with and without norm_before_residual), the reference's own code
builds a small random float32 head and saves it with its save_pretrained; eagle-serve's loader
reads that directory, both run the same token ids and the same captured target states (one
causal sequence from position 0), and the max abs difference of the draft logits and the
d2t-mapped top-1 ids are compared. Then the reverse: eagle-serve writes the head it loaded
(save_eagle3_head, same layout, the target's embedding included), the reference's
from_pretrained reads it (its loading info: missing, unexpected and mismatched keys; and the
written key set against the one the reference's own save writes), and the logits are compared
again. A head as `eagle-serve train-draft --arch eagle3` writes it (bfloat16, SpecForge's
layout) goes through the same reverse check.

SafeAILab's EAGLE repository has no EAGLE-3 code on PyPI (its package there predates EAGLE-3),
so its layout (SpecForge's file format without embed_tokens.weight, the head reading the target's
embedding, and without eagle_config, the captured layers being the default ones) is checked
through eagle-serve's loader only, against SpecForge's logits.

The references run in their own environment (bench/_eagle3_ref_worker.py): torch 2.13.0 (CPU),
transformers 5.8.1 (SpecForge's pin), and specforge / speculators installed without their
dependencies (those pull CUDA builds, sglang and vLLM); see the worker for the modules it stubs.
SpecForge's from_pretrained under transformers 5 leaves its attention's RoPE tables
uninitialized (its own saved heads included), so the worker rebuilds them after loading.

    .venv/bin/python bench/eagle3_interop.py --setup          # creates bench/out/ref-eagle3 first
    .venv/bin/python bench/eagle3_interop.py                  # uses bench/out/ref-eagle3
    .venv/bin/python bench/eagle3_interop.py --ref-python /path/to/python
Writes --out (bench/results/eagle3_interop.json).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file

from eagle_serve.engine.attention import make_backend
from eagle_serve.engine.forward_batch import SeqSpan, build_forward_batch
from eagle_serve.engine.kv_cache import KVCache
from eagle_serve.engine.model_config import ModelConfig
from eagle_serve.engine.models.llama import LlamaForCausalLM
from eagle_serve.engine.speculative.eagle3_head import load_draft_head, save_eagle3_head
from eagle_serve.engine.train.eagle3 import Eagle3TrainHead, save_eagle3

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "_eagle3_ref_worker.py")
REF_ENV = os.path.join("bench", "out", "ref-eagle3")
REF_PACKAGES = ["specforge==0.2.0", "speculators==0.9.0"]
REF_DEPS = ["torch==2.13.0", "transformers==5.8.1", "pydantic", "safetensors", "loguru==0.7.3"]

SIZES = dict(hidden=64, intermediate=160, heads=4, kv_heads=2, vocab=256, draft_vocab=128, eps=1e-5,
             max_positions=512, rope_theta=10000.0)
TARGET_LAYERS = 8
# the target layers whose outputs the head reads: HF hidden_states 2, 4, 5, the default (2, L // 2,
# L - 3) a config without ids (SafeAILab's) selects
AUX_LAYERS = (1, 3, 4)
POSITIONS = 8
BLOCK = 4
CPU = torch.device("cpu")
# (name, reference layout, norm_before_residual, the layout's captured-layer ids)
CASES = [("specforge", "specforge", False, list(AUX_LAYERS)),  # eagle_config: layers whose output is read
         ("speculators", "speculators", False, [i + 1 for i in AUX_LAYERS]),  # top level: HF indices
         ("speculators-nbr", "speculators", True, [i + 1 for i in AUX_LAYERS])]


def setup_env(path: str) -> str:
    py = os.path.join(path, "bin", "python")
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", path], check=True)
    pip = [py, "-m", "pip", "install", "-q"]
    subprocess.run(pip + REF_DEPS, check=True)  # torch pinned first: the CPU build
    subprocess.run(pip + ["--no-deps"] + REF_PACKAGES, check=True)
    return py


def target_model(embed: torch.Tensor) -> LlamaForCausalLM:
    """A tiny float32 Llama target: only its config, embedding and RoPE table are read."""
    s = SIZES
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": s["hidden"],
                               "intermediate_size": 128, "num_hidden_layers": TARGET_LAYERS,
                               "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
                               "vocab_size": s["vocab"], "rms_norm_eps": s["eps"],
                               "max_position_embeddings": s["max_positions"], "rope_theta": s["rope_theta"]})
    model = LlamaForCausalLM(cfg).float().eval()
    model.model.embed_tokens.weight.data = embed.clone()
    return model


def write_verifier(path: str, target: LlamaForCausalLM) -> str:
    """The target as a Hugging Face directory holding what speculators' loader reads from a
    verifier (config, embedding, lm_head, final norm)."""
    c = target.config
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
                   "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
                   "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
                   "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
                   "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": False}, f)
    gen = torch.Generator().manual_seed(3)
    save_file({"model.embed_tokens.weight": target.model.embed_tokens.weight.detach().contiguous(),
               "lm_head.weight": torch.randn(c.vocab_size, c.hidden_size, generator=gen),
               "model.norm.weight": torch.ones(c.hidden_size)}, os.path.join(path, "model.safetensors"))
    return path


def eagle_serve_logits(head, target, ids: torch.Tensor, aux: torch.Tensor):
    """(draft logits [T, Vd], top-1 target ids [T]) of the head over one sequence from
    position 0, through the drafter's own calls: forward, then lm_head(norm(z)) and draft_topk."""
    cfg = head.config
    T, H = len(ids), head.target_hidden
    kv = KVCache(1, (T + BLOCK - 1) // BLOCK, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32, CPU)
    backend = make_backend(cfg.head_dim ** -0.5, CPU, torch.float32, "torch")
    batch = build_forward_batch([SeqSpan(ids.tolist(), 0, list(range(kv.num_blocks)))], BLOCK, CPU)
    embed = head.embed_tokens if head.embed_tokens is not None else target.model.embed_tokens
    f = torch.randn(T, H, generator=torch.Generator().manual_seed(7))  # the target's final feature: unread
    with torch.inference_mode():
        z = head(embed(batch.input_ids), torch.cat([f, aux], -1), batch, kv, backend,
                 head.rotary or target.model.rotary)
        logits = head.lm_head(head.norm(z), float_out=True).float()
        _, top = head.draft_topk(z, target, 1)
    return logits, top[:, 0].long()


def run_worker(py: str, job: dict, work: str) -> tuple[dict, dict]:
    name = f"{job['case']}-{job['op']}"
    job = {**job, "out": os.path.join(work, name + ".out.safetensors"), "result": os.path.join(work, name + ".json")}
    job_file = os.path.join(work, name + ".job.json")
    with open(job_file, "w", encoding="utf-8") as f:
        json.dump(job, f)
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([py, WORKER, job_file], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"reference worker failed ({name}):\n{proc.stderr[-4000:]}")
    with open(job["result"], encoding="utf-8") as f:
        return json.load(f), load_file(job["out"])


def compare(ref: dict, logits: torch.Tensor, top: torch.Tensor) -> dict:
    diff = (ref["logits"] - logits).abs()
    return {"max_abs_logit_diff": float(diff.max()), "max_abs_logit": float(ref["logits"].abs().max()),
            "top1_ids_equal": bool(torch.equal(ref["top1"], top)), "top1_mismatches": int((ref["top1"] != top).sum())}


def key_report(info: dict, reference_save_keys: list[str]) -> dict:
    """The reference loader's loading info and the strict key comparison of the written file
    against the reference model's state and against the file the reference's own save writes."""
    file_keys, model_keys = set(info["file_keys"]), set(info["model_keys"])
    li = info["loading_info"]
    return {"missing_keys": li.get("missing_keys", []), "unexpected_keys": li.get("unexpected_keys", []),
            "mismatched_keys": li.get("mismatched_keys", []),
            "file_keys_not_in_model": sorted(file_keys - model_keys),
            "model_keys_not_in_file": sorted(model_keys - file_keys),
            "model_keys_the_reference_does_not_save": info.get("keys_not_saved", []),
            "same_keys_as_reference_save": file_keys == set(reference_save_keys),
            "keys_written": sorted(file_keys)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref-python", help="an interpreter with specforge and speculators (default: the "
                                         f"{REF_ENV} environment)")
    ap.add_argument("--setup", action="store_true", help=f"create or update {REF_ENV} first")
    ap.add_argument("--work", default=os.path.join("bench", "out", "eagle3-interop"),
                    help="scratch directory for the heads and the worker's files")
    ap.add_argument("--out", default=os.path.join("bench", "results", "eagle3_interop.json"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.chdir(ROOT)
    py = args.ref_python or os.path.join(REF_ENV, "bin", "python")
    if args.setup and not args.ref_python:
        py = setup_env(REF_ENV)
    if not os.path.exists(py):
        sys.exit(f"no reference interpreter at {py}: pass --setup (creates {REF_ENV}) or --ref-python")
    work = os.path.abspath(args.work)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)

    s = SIZES
    gen = torch.Generator().manual_seed(args.seed)
    inputs = {"ids": torch.randint(0, s["vocab"], (POSITIONS,), generator=gen),
              "aux": torch.randn(POSITIONS, len(AUX_LAYERS) * s["hidden"], generator=gen),
              "embed": torch.randn(s["vocab"], s["hidden"], generator=gen)}
    draft_ids = sorted(torch.randperm(s["vocab"], generator=gen)[:s["draft_vocab"]].tolist())
    inputs_file = os.path.join(work, "inputs.safetensors")
    save_file(inputs, inputs_file)
    target = target_model(inputs["embed"])
    verifier = write_verifier(os.path.join(work, "target"), target)

    cases, versions, stubbed = [], {}, set()
    for i, (name, layout, nbr, ids) in enumerate(CASES):
        built_dir, written_dir = os.path.join(work, name + "-reference"), os.path.join(work, name + "-eagle-serve")
        job = {"case": name, "layout": layout, "inputs": inputs_file, "seed": args.seed + 1 + i}
        built, ref_out = run_worker(py, {**job, "op": "build", "dir": built_dir, "sizes": s, "aux_ids": ids,
                                         "norm_before_residual": nbr, "draft_vocab_ids": draft_ids}, work)
        versions.update(built["reference"])
        stubbed.update(built["stubbed_modules"])
        head = load_draft_head(built_dir, target, torch.float32, "eagle3")
        assert head.aux_layers == AUX_LAYERS, (name, head.aux_layers)
        logits, top = eagle_serve_logits(head, target, inputs["ids"], inputs["aux"])
        forward = compare(ref_out, logits, top)
        save_eagle3_head(head, written_dir, layout, embed=target.model.embed_tokens.weight,
                         verifier=verifier if layout == "speculators" else None)
        loaded, back_out = run_worker(py, {**job, "op": "load", "dir": written_dir}, work)
        head2 = load_draft_head(written_dir, target, torch.float32, "eagle3")
        logits2, top2 = eagle_serve_logits(head2, target, inputs["ids"], inputs["aux"])
        case = {"case": name, "layout": layout, "reference_class": built["class"], "norm_before_residual": nbr,
                "reference_config_architectures": _architectures(built_dir),
                "reference_head_in_eagle_serve": {**forward, "reference_saved_keys": built["file_keys"]},
                "eagle_serve_head_in_reference": {**key_report(loaded, built["file_keys"]),
                                                  **compare(back_out, logits2, top2),
                                                  "max_abs_diff_to_reference_built_head": float(
                                                      (back_out["logits"] - ref_out["logits"]).abs().max())}}
        if layout == "speculators":
            case["reference_attn_implementation"] = loaded.get("attn_implementation")
        else:  # see the worker's specforge_load
            case["eagle_serve_head_in_reference"]["reference_rope_tables_rebuilt_after_load"] = loaded.get(
                "rope_tables_rebuilt", False)
            case["eagle_serve_head_in_reference"]["reference_rope_tables_as_loaded_were_wrong"] = loaded.get(
                "rope_tables_as_loaded_were_wrong")
        cases.append(case)
        if name == "specforge":  # SafeAILab's layout: the same file without the embedding and the ids
            safe_dir = os.path.join(work, "safeailab")
            shutil.copytree(built_dir, safe_dir)
            w = load_file(os.path.join(safe_dir, "model.safetensors"))
            del w["embed_tokens.weight"]
            save_file(w, os.path.join(safe_dir, "model.safetensors"))
            with open(os.path.join(safe_dir, "config.json"), encoding="utf-8") as f:
                raw = json.load(f)
            del raw["eagle_config"]
            with open(os.path.join(safe_dir, "config.json"), "w", encoding="utf-8") as f:
                json.dump(raw, f)
            head3 = load_draft_head(safe_dir, target, torch.float32, "eagle3")
            assert head3.aux_layers == AUX_LAYERS, head3.aux_layers
            logits3, top3 = eagle_serve_logits(head3, target, inputs["ids"], inputs["aux"])
            safeailab = {"case": "safeailab", "reference": None,
                         "note": "no EAGLE-3 reference on PyPI: SpecForge's head file without embed_tokens.weight "
                                 "(the head reads the target's embedding) and without eagle_config (the default "
                                 "captured layers), eagle-serve's loader only, compared with SpecForge's logits",
                         "eagle_serve_shares_target_embedding": head3.embed_tokens is None,
                         **compare(ref_out, logits3, top3)}

    # a head as `eagle-serve train-draft --arch eagle3` writes it (bfloat16, SpecForge's layout)
    trained_dir = os.path.join(work, "train-draft")
    trained = Eagle3TrainHead(target.config, AUX_LAYERS, torch.zeros(s["draft_vocab"], s["hidden"]))
    gen = torch.Generator().manual_seed(args.seed + 11)
    with torch.no_grad():
        for _, p in sorted(trained.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if p.dim() == 1 else 0.1 * noise)
    save_eagle3(trained, trained_dir, target, torch.tensor(draft_ids), dtype=torch.bfloat16)
    loaded, back_out = run_worker(py, {"case": "train-draft", "layout": "specforge", "inputs": inputs_file,
                                       "op": "load", "dir": trained_dir}, work)
    head4 = load_draft_head(trained_dir, target, torch.float32, "eagle3")
    logits4, top4 = eagle_serve_logits(head4, target, inputs["ids"], inputs["aux"])
    train_draft = {"case": "train-draft", "layout": "specforge", "dtype_written": "bfloat16",
                   "note": "a random Eagle3TrainHead written by train-draft's save_eagle3; no reference-built "
                           "counterpart, so only the eagle-serve -> reference direction",
                   "eagle_serve_head_in_reference": {
                       **key_report(loaded, cases[0]["reference_head_in_eagle_serve"]["reference_saved_keys"]),
                       **compare(back_out, logits4, top4),
                       "reference_rope_tables_rebuilt_after_load": loaded.get("rope_tables_rebuilt", False)}}

    out = {"what": "EAGLE-3 draft logits of eagle-serve against the reference implementations on the same "
                   "token ids and captured target states; heads eagle-serve writes loaded by the references",
           "dtype": "float32", "device": "cpu", "reference_packages": versions,
           "reference_install": "torch and transformers pinned, specforge and speculators with --no-deps",
           "stubbed_modules": sorted(stubbed),
           "stub_reason": "speculators' package import reaches its training-data modules, which import these; "
                          "the EAGLE-3 model code uses none of them",
           "reference_issues": ["SpecForge 0.2.0's AutoDraftModel.from_pretrained under transformers 5.8.1 "
                                "builds the model on the meta device, so its attention's RoPE tables (non-persistent "
                                "buffers inv_freq, cos_cached, sin_cached) are left uninitialized, for heads SpecForge "
                                "saves itself as well: the worker rebuilds them with the attention's _init_rope",
                                "speculators 0.9.0's from_pretrained needs the verifier (the target) named in the "
                                "config: eagle-serve's writer takes it as `verifier`; its "
                                "Eagle3DraftModel.from_pretrained does not pass output_loading_info through, so the "
                                "loading info comes from the "
                                "Hugging Face from_pretrained it wraps"],
           "torch_compile": "disabled (TORCHDYNAMO_DISABLE=1): SpecForge wraps RMSNorm and RoPE in torch.compile",
           "sizes": {**s, "target_layers": TARGET_LAYERS, "target_layers_read": list(AUX_LAYERS),
                     "positions": POSITIONS},
           "seed": args.seed, "cases": cases + [safeailab, train_draft]}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print_table(out)
    print(f"wrote {args.out}")


def _architectures(path: str):
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f).get("architectures")


def print_table(out: dict) -> None:
    print(f"references: {', '.join(f'{k} {v}' for k, v in out['reference_packages'].items())}")
    print(f"{'case':<16} {'ref -> eagle-serve':>20} {'top-1':>6} {'eagle-serve -> ref':>20} {'top-1':>6}  keys")
    for c in out["cases"]:
        if c["case"] == "safeailab":
            print(f"{'safeailab':<16} {c['max_abs_logit_diff']:>20.3g} {str(c['top1_ids_equal']):>6} "
                  f"{'(no reference)':>20} {'':>6}  -")
            continue
        a, b = c.get("reference_head_in_eagle_serve"), c["eagle_serve_head_in_reference"]
        bad = b["missing_keys"] + b["unexpected_keys"] + b["mismatched_keys"] + b["file_keys_not_in_model"]
        keys = "ok" if not bad and b["same_keys_as_reference_save"] else f"MISMATCH {bad}"
        fwd = (f"{a['max_abs_logit_diff']:>20.3g} {str(a['top1_ids_equal']):>6}" if a
               else f"{'(eagle-serve made)':>20} {'':>6}")
        print(f"{c['case']:<16} {fwd} {b['max_abs_logit_diff']:>20.3g} {str(b['top1_ids_equal']):>6}  {keys}")


if __name__ == "__main__":
    main()
