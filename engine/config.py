"""Engine settings, parsed once at the edge (CLI / LLM) and validated here."""
from __future__ import annotations

from dataclasses import dataclass, replace

from eagle_serve.engine.speculative.config import SpecConfig
from eagle_serve.engine.speculative.eagle3_config import is_eagle3_dir

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("auto", "none", "int8")
# auto: flash on CUDA when flash-attn imports (else torch), native on the CPU where its kernels
# build (else torch); see engine.attention.make_backend
ATTENTIONS = ("auto", "torch", "native", "flash")
# a draft head's weights on the CPU: auto = int8 where the native kernels run (Linear.quantize_int8),
# with int8 inputs too (w8a8) where they have VNNI dot products (the AVX-512 build)
DRAFT_QUANTIZATIONS = ("auto", "w8a8", "int8", "none")
ENV_TRUE, ENV_FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(value: str) -> bool | None:
    """An on / off environment value: one of ENV_TRUE / ENV_FALSE (any case, spaces around),
    None for an empty one; anything else is a ValueError (a typo must not leave the default)."""
    flag = value.strip().lower()
    if flag == "":
        return None
    if flag not in ENV_TRUE + ENV_FALSE:
        raise ValueError(f"{value!r}: expected 1/0, true/false, yes/no or on/off")
    return flag in ENV_TRUE


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded default model
    dtype: str = "auto"  # auto: bfloat16 where the CPU has native bf16 (measured fastest), else float32
    # one of QUANTIZATIONS (engine/loader.py load_model): auto keeps a GGUF file's block-quantized
    # weights quantized on the CPU, none dequantizes them, int8 quantizes an HF checkpoint to Q8_0
    quantization: str = "auto"
    device: str = "auto"
    attention: str = "auto"  # one of ATTENTIONS; flash reads the cache in place with block_size 256
    block_size: int = 16
    kv_cache_tokens: int | None = None  # None: kv_cache_memory_fraction of RAM; CUDA: gpu_memory_utilization
    kv_cache_memory_fraction: float = 0.1
    max_model_len: int | None = None  # None: the model's own, capped to what the cache holds
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_prefill_chunk: int = 512  # prompt tokens one sequence feeds per step (chunked prefill)
    enable_prefix_caching: bool = True
    tree_budget: bool = True  # size each round's trees by the load-aware budget (speculation only)
    skip_tokenizer: bool = False
    draft: str | None = None  # EAGLE head directory
    # the head's weights as int8 for its few-row products (CPU, native kernels; drafting only
    # proposes, so the output does not change): one of DRAFT_QUANTIZATIONS; w8a8: their inputs
    # rounded to 8 bits too, as VNNI dot products (AVX-512 build)
    draft_quantization: str = "auto"
    # None: eagle2 where a draft head is given, else none (as the CLI); a method name is its defaults.
    # eagle2 with an EAGLE-3 head (engine.speculative.eagle3_config) is eagle3
    spec: SpecConfig | str | None = None
    # CUDA only (engine/cuda_graphs.py, docs/gpu.md): replay captured graphs for decode / verify steps
    cuda_graphs: bool = True
    cuda_graph_batch_sizes: tuple[int, ...] | None = None  # None: 1, 2, 4, ... up to max_num_seqs
    cuda_graph_token_sizes: tuple[int, ...] | None = None  # None: 1, 2, 4, ... up to the largest tree
    # CUDA, kv_cache_tokens None: fraction of the GPU's memory for weights + activations + KV cache
    gpu_memory_utilization: float = 0.9

    def __post_init__(self):
        spec = self.spec
        if spec is None:
            spec = SpecConfig("eagle2" if self.draft else "none")
        elif isinstance(spec, str):
            spec = SpecConfig(spec)
        elif not isinstance(spec, SpecConfig):
            raise ValueError(f"spec must be a SpecConfig or a method name, got {spec!r}")
        if self.draft is not None and spec.method in ("ngram", "none"):
            raise ValueError(f"a draft head does not apply to spec {spec.method!r} (eagle2, eagle3 and eagle1 "
                             "read one)")
        if spec.method == "eagle2" and self.draft is not None and is_eagle3_dir(self.draft):
            spec = replace(spec, method="eagle3")  # the same dynamic tree, drafted by the EAGLE-3 head
        object.__setattr__(self, "spec", spec)
        if self.draft_quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"draft_quantization must be one of {DRAFT_QUANTIZATIONS}, got {self.draft_quantization!r}")
        if self.draft_quantization != "auto" and not spec.uses_head:
            raise ValueError(f"draft_quantization {self.draft_quantization!r} applies to an EAGLE draft head "
                             f"(spec {spec.method!r} has none)")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens must be >= block_size ({self.block_size})")
        if not 0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError("kv_cache_memory_fraction must be in (0, 0.95]")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("cuda_graph_batch_sizes", "cuda_graph_token_sizes"):
            sizes = getattr(self, name)
            if sizes is not None and (not sizes or min(sizes) < 1):
                raise ValueError(f"{name} must be positive sizes, got {sizes}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
