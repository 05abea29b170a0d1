"""Re-pick a draft head's reduced vocabulary from the assistant tokens of some conversations.

A head's draft LM head is the target's own LM head restricted to `d2t` (the draft vocabulary's
target ids, `train-draft --draft-vocab K`); the head has no weights of its own for it, so the
vocabulary can be re-picked without retraining: the K most frequent assistant tokens of the
given JSONL files (end-of-turn ids always in), counted on the ids the target generated
(`token_ids`, as `train-draft --regenerate` and scripts/self_prompts.py write them) or, for
turns without them, on the chat-template rendering. The head's weights are copied unchanged;
fine-tune it (`train-draft --init OUT`) so its token loss sees the new vocabulary.

    python scripts/draft_vocab.py --head engine/heads/smollm2-135m-instruct \
        --data SELF.jsonl,SELF2.jsonl,RUN/regenerated.jsonl --k 16384 --out HEAD16K

Prints the coverage of the new and the old vocabulary on the counted tokens (and, with
--eval FILE, on another file's assistant tokens: a check, never a source of the ranking).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def assistant_ids(files: list[str], tokenizer, max_len: int = 1 << 20, vocab_size: int | None = None):
    """All assistant-token ids of the conversations in `files` (a torch tensor); with
    vocab_size, generated `token_ids` past it are refused (they belong to another model)."""
    import torch
    from eagle_serve.engine.train.data import check_token_ids, load_conversations, render
    out = []
    for path in files:
        convs = load_conversations(path, None)
        if vocab_size is not None:
            check_token_ids(convs, vocab_size, path)
        for conv in convs:
            ex = render(tokenizer, conv, max_len)
            if ex is not None:
                out.extend(i for i, m in zip(ex.ids, ex.mask) if m)
    return torch.tensor(out, dtype=torch.long)


def coverage(ids, d2t) -> float:
    import torch
    return float(torch.isin(ids, d2t).float().mean()) if len(ids) else float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", required=True, help="the head directory to copy")
    p.add_argument("--data", required=True, help="comma-separated JSONL files whose assistant tokens are counted")
    p.add_argument("--k", type=int, required=True, help="draft vocabulary size")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None, help="target (default: the embedded default model)")
    p.add_argument("--eval", default=None, help="JSONL file to report coverage on (not counted)")
    args = p.parse_args(argv)
    data = [x for x in args.data.split(",") if x]
    for path in data + ([args.eval] if args.eval else []):  # before the model loads
        if not os.path.isfile(path):
            raise SystemExit(f"draft_vocab: no such data file: {path}")
    if not os.path.isfile(os.path.join(args.head, "model.safetensors")):
        raise SystemExit(f"draft_vocab: --head {args.head}: no model.safetensors there")
    try:
        return run(args, data)
    except (ValueError, OSError) as e:  # DataError, ModelLoadError, unreadable files: named, no traceback
        raise SystemExit(f"draft_vocab: {e}") from None


def run(args, data: list[str]) -> int:
    import torch
    from safetensors.torch import load_file, save_file
    from eagle_serve.engine.loader import load_model, read_json
    from eagle_serve.engine.speculative.eagle_head import load_eagle_head
    from eagle_serve.engine.train.losses import build_draft_vocab
    loaded = load_model(args.model, torch.float32, torch.device("cpu"))
    vocab = loaded.config.vocab_size
    if not 2 <= args.k <= vocab:
        raise SystemExit(f"--k must be in [2, {vocab}]")
    load_eagle_head(args.head, loaded.model, torch.float32)  # a head for another target is refused here
    config = read_json(os.path.join(args.head, "config.json"))
    weights = load_file(os.path.join(args.head, "model.safetensors"))
    ids = assistant_ids(data, loaded.tokenizer, vocab_size=vocab)
    if not len(ids):
        raise SystemExit("no assistant tokens in --data")
    d2t = build_draft_vocab(ids, torch.ones_like(ids, dtype=torch.bool), args.k, vocab, sorted(loaded.eos_token_ids))
    old = weights.get("d2t")
    report = {"counted_tokens": len(ids), "distinct": int(ids.unique().numel()), "k": args.k,
              "coverage_new": coverage(ids, d2t), "coverage_old": coverage(ids, old) if old is not None else 1.0}
    if args.eval:
        ev = assistant_ids([args.eval], loaded.tokenizer, vocab_size=vocab)
        report.update(eval_tokens=len(ev), eval_coverage_new=coverage(ev, d2t),
                      eval_coverage_old=coverage(ev, old) if old is not None else 1.0)
    os.makedirs(args.out, exist_ok=True)
    same = os.path.samefile(args.head, args.out)  # re-picked in place: the other files are already there
    for name in os.listdir(args.head):  # anything else travels along; card.json describes the replaced vocabulary
        if not same and name not in ("model.safetensors", "config.json", "card.json") \
                and os.path.isfile(os.path.join(args.head, name)):
            shutil.copy2(os.path.join(args.head, name), os.path.join(args.out, name))
    if same and os.path.exists(os.path.join(args.out, "card.json")):
        os.remove(os.path.join(args.out, "card.json"))  # it describes the replaced vocabulary
    weights = {k: v.clone() for k, v in weights.items()}  # off the file's memory map before it is replaced
    weights["d2t"] = d2t.to(torch.int64).contiguous()
    tmp = os.path.join(args.out, "model.safetensors.tmp")
    save_file(weights, tmp)
    os.replace(tmp, os.path.join(args.out, "model.safetensors"))
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump({**config, "draft_vocab_size": args.k}, f, indent=2)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
