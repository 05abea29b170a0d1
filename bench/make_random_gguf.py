#!/usr/bin/env python
"""Random-weight Llama GGUF files at real model shapes, for speed benchmarks of quantized weights.

    .venv/bin/python bench/make_random_gguf.py --shape 1b --type q8_0
    .venv/bin/python bench/make_random_gguf.py --shape 3b --type q4_0,q4_k --llama-quantize PATH
    .venv/bin/python bench/make_random_gguf.py --shape default --type q8_0   # the default model, requantized

Shapes (Llama 3.2; tied embeddings, rope theta 500000, no rope scaling tensor)
  1b    hidden 2048, 16 layers, 32 heads, 8 kv heads, head_dim 64, ffn 8192, vocab 128256
  3b    hidden 3072, 28 layers, 24 heads, 8 kv heads, head_dim 128, ffn 8192, vocab 128256
  tiny  hidden 256, 2 layers, 4 heads, 2 kv heads, head_dim 64, ffn 768, vocab 49280 (tests)
  default  not random: the embedded default model's own weights (SmolLM2-135M, Q4_1) dequantized
        and written in --type, so that its EAGLE head still applies
Weights: normal(0, --std) seeded per tensor from --seed (the same file for the same arguments);
norms 1.0. The tokenizer is the default model's (tokenizer.ggml.* and the chat template copied),
its token list padded with unused tokens `<|unused_N|>` (type UNUSED) up to the shape's vocab,
so llama.cpp and transformers both load it.
Types: f16, q8_0 and q4_0 are written here (every 2-D weight in that type, the token embedding
too: what llama-quantize --pure gives; norms stay f32); q4_k, q6_k (every weight in that type,
llama-quantize --pure) and q4_k_m (llama.cpp's own mix) go through llama-quantize from an f16
file written first and deleted afterwards unless --keep-f16 (--llama-quantize or
$LLAMA_QUANTIZE; its folder or $LLAMACPP_BIN).
Output: --out-dir (default bench/out, git-ignored), <shape>-<type>.gguf. Prints one json line
per file (name, bytes, weight_bytes).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float = 500000.0
    context: int = 8192
    label: str = ""


SHAPES = {
    "1b": Shape(2048, 16, 32, 8, 64, 8192, 128256, label="1B"),
    "3b": Shape(3072, 28, 24, 8, 128, 8192, 128256, label="3B"),
    "tiny": Shape(256, 2, 4, 2, 64, 768, 49280, label="tiny"),
}
DIRECT = {"f16": QT.F16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0}
FILE_TYPE = {"f16": 1, "q8_0": 7, "q4_0": 2}  # llama_ftype (general.file_type)
# llama-quantize type names and whether every tensor gets that type (--pure)
VIA_QUANTIZE = {"q4_k": ("Q4_K_M", True), "q6_k": ("Q6_K", True), "q4_k_m": ("Q4_K_M", False)}
TYPES = tuple(DIRECT) + tuple(VIA_QUANTIZE)
TOKENIZER_KEYS_SKIP = {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"}
ROWS_PER_CHUNK = 4096


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="1b", help="1b, 3b, tiny or default (comma-separated for several)")
    ap.add_argument("--type", default="q8_0", help=f"one or more of {', '.join(TYPES)} (comma-separated)")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "out"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--llama-quantize", default=os.environ.get("LLAMA_QUANTIZE"),
                    help="llama-quantize binary for the k-quant types (default $LLAMA_QUANTIZE, "
                         "else $LLAMACPP_BIN/llama-quantize, else on PATH)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--keep-f16", action="store_true", help="keep the f16 file made for llama-quantize")
    ap.add_argument("--force", action="store_true", help="rewrite files that exist")
    args = ap.parse_args(argv)
    args.shape = [s for s in args.shape.split(",") if s]
    args.type = [t for t in args.type.split(",") if t]
    for s in args.shape:
        if s not in SHAPES and s != "default":
            ap.error(f"unknown shape {s!r}")
    for t in args.type:
        if t not in TYPES:
            ap.error(f"unknown type {t!r} (one of {', '.join(TYPES)})")
    return args


def out_path(out_dir: str, shape: str, qtype: str) -> str:
    return os.path.join(out_dir, f"{shape}-{qtype}.gguf")


def weight_bytes(path: str) -> int:
    """Sum of the tensors' stored bytes."""
    return int(sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors))


def default_reader() -> gguf.GGUFReader:
    from eagle_serve.engine.default_model import default_model_path
    return gguf.GGUFReader(default_model_path())


# ---------------------------------------------------------------- metadata

def copy_field(writer: gguf.GGUFWriter, field) -> None:
    """One key/value of another GGUF, same value type."""
    vtype = field.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
        sub = field.types[-1]
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    else:
        writer.add_key_value(field.name, field.contents(), vtype)


def add_tokenizer(writer: gguf.GGUFWriter, src: gguf.GGUFReader, vocab: int) -> None:
    """The source's tokenizer, its token list padded with UNUSED tokens up to `vocab`."""
    tokens = list(src.fields["tokenizer.ggml.tokens"].contents())
    types = list(src.fields["tokenizer.ggml.token_type"].contents())
    if vocab < len(tokens):
        raise ValueError(f"vocab {vocab} is smaller than the tokenizer's {len(tokens)} tokens")
    pad = vocab - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(pad)]
    types += [int(gguf.TokenType.UNUSED)] * pad
    for key, field in src.fields.items():
        if key.startswith("tokenizer.") and key not in TOKENIZER_KEYS_SKIP:
            copy_field(writer, field)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if "tokenizer.ggml.scores" in src.fields:
        writer.add_token_scores(list(src.fields["tokenizer.ggml.scores"].contents()) + [0.0] * pad)


def add_hparams(writer: gguf.GGUFWriter, s: Shape, name: str, qtype: str) -> None:
    writer.add_name(name)
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_block_count(s.layers)
    writer.add_feed_forward_length(s.ffn)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(s.vocab)
    writer.add_file_type(FILE_TYPE[qtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def tensor_list(s: Shape) -> list[tuple[str, tuple[int, int] | tuple[int]]]:
    """(name, numpy shape: rows = outputs, columns = inputs) in llama.cpp's order."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out: list = [("token_embd.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (s.hidden,)),
                (b + "attn_q.weight", (q, s.hidden)), (b + "attn_k.weight", (kv, s.hidden)),
                (b + "attn_v.weight", (kv, s.hidden)), (b + "attn_output.weight", (s.hidden, q)),
                (b + "ffn_norm.weight", (s.hidden,)),
                (b + "ffn_gate.weight", (s.ffn, s.hidden)), (b + "ffn_up.weight", (s.ffn, s.hidden)),
                (b + "ffn_down.weight", (s.hidden, s.ffn))]
    out.append(("output_norm.weight", (s.hidden,)))
    return out


# ---------------------------------------------------------------- tensors

def encode(x: np.ndarray, qt: QT) -> np.ndarray:
    """float32 rows -> stored bytes / values of type qt."""
    if qt == QT.F32:
        return x.astype(np.float32)
    if qt == QT.F16:
        return x.astype(np.float16)
    return quantize(x, qt)


def stored_nbytes(shape: tuple[int, ...], qt: QT) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qt]
    n = int(np.prod(shape))
    return n // block * size


def write_streamed(path: str, writer_setup, tensors: list[tuple[str, tuple, QT]], rows_of) -> None:
    """Header, metadata and tensor infos first, then each tensor's data made chunk by chunk
    (rows_of(name, shape, row0, row1) -> float32 rows), so a 3B model never sits in memory."""
    tmp = path + ".part"
    writer = gguf.GGUFWriter(tmp, "llama")
    writer_setup(writer)
    for name, shape, qt in tensors:
        nbytes = stored_nbytes(shape, qt)
        if qt in (QT.F32, QT.F16):
            writer.add_tensor_info(name, shape, np.dtype(np.float32 if qt == QT.F32 else np.float16), nbytes)
        else:
            byte_shape = (*shape[:-1], shape[-1] // gguf.GGML_QUANT_SIZES[qt][0] * gguf.GGML_QUANT_SIZES[qt][1])
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    for name, shape, qt in tensors:
        writer.write_padding(fout, fout.tell())
        rows = shape[0] if len(shape) == 2 else 1
        step = max(1, ROWS_PER_CHUNK * 2048 // shape[-1]) if len(shape) == 2 else 1
        written = 0
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            data = encode(rows_of(name, shape, r0, r1), qt)
            data.tofile(fout)
            written += data.nbytes
        assert written == stored_nbytes(shape, qt), (name, written)
        writer.write_padding(fout, written)
    writer.close()
    os.replace(tmp, path)


def write_random(path: str, shape_name: str, qtype: str, seed: int, std: float) -> None:
    s = SHAPES[shape_name]
    src = default_reader()
    qt = DIRECT[qtype]
    names = tensor_list(s)
    tensors = [(n, shp, QT.F32 if len(shp) == 1 else qt) for n, shp in names]
    index = {n: i for i, (n, _) in enumerate(names)}

    def setup(w):
        add_hparams(w, s, f"random-llama-{s.label}", qtype)
        add_tokenizer(w, src, s.vocab)

    def rows_of(name, shp, r0, r1):
        if len(shp) == 1:
            return np.ones(shp, dtype=np.float32)
        # one generator per (seed, tensor, chunk start): the same values whatever the chunking
        # of earlier tensors
        rng = np.random.default_rng([seed, index[name], r0])
        x = rng.standard_normal((r1 - r0, shp[1]), dtype=np.float32)
        x *= std
        return x

    write_streamed(path, setup, tensors, rows_of)


def write_default(path: str, qtype: str) -> None:
    """The default model's weights (dequantized) in qtype; its metadata as is."""
    src = default_reader()
    qt = DIRECT[qtype]
    by_name = {t.name: t for t in src.tensors}
    tensors = []
    for t in src.tensors:
        shp = tuple(int(d) for d in reversed(t.shape.tolist()))  # numpy order
        keep = len(shp) == 1 or t.tensor_type == QT.F32
        tensors.append((t.name, shp, QT.F32 if keep else qt))
    cache: dict[str, np.ndarray] = {}

    def setup(w):
        for key, field in src.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            if key == "general.file_type":
                w.add_file_type(FILE_TYPE[qtype])
                continue
            copy_field(w, field)

    def rows_of(name, shp, r0, r1):
        if name not in cache:
            cache.clear()
            t = by_name[name]
            cache[name] = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shp)
        return cache[name][r0:r1] if len(shp) == 2 else cache[name]

    write_streamed(path, setup, tensors, rows_of)


def find_quantize(arg: str | None) -> str:
    cand = arg or (os.path.join(os.environ["LLAMACPP_BIN"], "llama-quantize") if os.environ.get("LLAMACPP_BIN") else None) \
        or shutil.which("llama-quantize")
    if not cand or not os.path.exists(cand):
        raise SystemExit("the k-quant types need llama-quantize: --llama-quantize PATH or $LLAMA_QUANTIZE / $LLAMACPP_BIN")
    return cand


def llama_quantize(binary: str, src: str, dst: str, qtype: str, threads: int) -> None:
    name, pure = VIA_QUANTIZE[qtype]
    if qtype == "q4_k":
        name = "Q4_K_M"  # with --pure every tensor is the mix's base type, Q4_K
    cmd = [binary] + (["--pure"] if pure else []) + [src, dst + ".part", name, str(threads)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama-quantize failed ({r.returncode}): {r.stderr[-2000:]}")
    os.replace(dst + ".part", dst)


def make(shape: str, qtype: str, args) -> str:
    os.makedirs(args.out_dir, exist_ok=True)
    path = out_path(args.out_dir, shape, qtype)
    if os.path.exists(path) and not args.force:
        return path
    t0 = time.perf_counter()
    if qtype in DIRECT:
        if shape == "default":
            write_default(path, qtype)
        else:
            write_random(path, shape, qtype, args.seed, args.std)
    else:
        binary = find_quantize(args.llama_quantize)
        f16 = make(shape, "f16", args)  # deleted by main() after the shape's last k-quant
        llama_quantize(binary, f16, path, qtype, args.threads)
    print(f"wrote {os.path.basename(path)} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return path


def main(argv=None) -> None:
    args = parse_args(argv)
    for shape in args.shape:
        f16 = out_path(args.out_dir, shape, "f16")
        had_f16 = os.path.exists(f16)
        for t in args.type:
            path = make(shape, t, args)
            print(json.dumps({"file": os.path.basename(path), "bytes": os.path.getsize(path),
                              "weight_bytes": weight_bytes(path)}), flush=True)
        # the f16 file made for the k-quants: deleted unless asked for or there before
        if os.path.exists(f16) and not had_f16 and "f16" not in args.type and not args.keep_f16:
            os.remove(f16)


if __name__ == "__main__":
    main()
