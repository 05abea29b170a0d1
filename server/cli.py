"""`eagle-serve` command line."""
from __future__ import annotations

import argparse
import json
import sys
import time

from engine.config import DEVICES, DTYPES
from engine.spec.config import METHODS


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--device", default="auto", help=f"one of {DEVICES} or cuda:N")
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--draft", default=None, help="EAGLE draft head directory (eagle2 / eagle1)")
    p.add_argument("--spec", default=None, choices=METHODS,
                   help="speculative method (default: eagle2 with --draft, else none)")
    p.add_argument("--total-tokens", type=int, default=None, help="tokens verified per round, root included")
    p.add_argument("--depth", type=int, default=None, help="draft depth per round")
    p.add_argument("--top-k", type=int, default=None, help="children expanded per tree node (eagle2)")
    p.add_argument("--static-tree", default=None, help="JSON file: list of child-rank paths (eagle1)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle-serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion for one prompt")
    _add_engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--sampling-top-k", type=int, default=-1, help="sample among the k most likely tokens")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    return parser


def cmd_generate(args) -> int:
    from engine.sampling_params import SamplingParams
    from server.llm import LLM
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.sampling_top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, kv_cache_tokens=args.kv_cache_tokens,
              max_model_len=args.max_model_len, block_size=args.block_size, draft=args.draft,
              spec=spec_config(args))
    if args.chat:
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt = llm.encode(args.prompt)
    t0 = time.perf_counter()
    out = llm.generate(prompt, params)[0]
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps({
            "text": out.text, "token_ids": out.token_ids, "num_prompt_tokens": len(prompt),
            "num_generated_tokens": len(out.token_ids), "elapsed_s": round(elapsed, 4),
            "tokens_per_s": round(len(out.token_ids) / elapsed, 2), "finish_reason": out.finish_reason,
            "spec": spec_summary(llm.engine_config.spec.method, out.spec),
        }))
    else:
        print(out.text)
    return 0


def spec_config(args):
    """SpecConfig from the flags: given values override the method's defaults."""
    from engine.spec.config import SpecConfig
    method = args.spec or ("eagle2" if args.draft else "none")
    kwargs = {k: v for k, v in (("total_tokens", args.total_tokens), ("depth", args.depth),
                                ("top_k", args.top_k)) if v is not None}
    if args.static_tree:
        with open(args.static_tree) as f:
            kwargs["static_tree"] = tuple(tuple(p) for p in json.load(f))
    return SpecConfig(method, **kwargs)


def spec_summary(method: str, stats) -> dict:
    steps = stats.verify_steps
    return {"method": method, "verify_steps": steps, "draft_tokens": stats.draft_tokens,
            "accepted_tokens": stats.accepted_tokens,
            "acceptance_length": round((stats.accepted_tokens + steps) / steps, 4) if steps else None,
            "accepted_per_depth": list(stats.accepted_per_depth)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"eagle-serve: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
