"""The KV-cache calculator: how big the cache is, how many requests fit, how memory-bound attention is.

Everything here is arithmetic on an `AttentionShape`; nothing is allocated. The
numbers are the ones that decide serving capacity: bytes per token times
tokens in flight must fit beside the weights, and decode reads all of it every
step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from attnserve.dtypes import resolve_dtypes
from attnserve.kvcache.dtypes import dtype_bytes
from attnserve.shape import AttentionShape

# bytes per weight element, by the names quantised checkpoints use
WEIGHT_DTYPE_BYTES: dict[str, float] = {
    "fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "fp4": 0.5, "int4": 0.5,
}
ACTIVATION_BYTES = 2  # q and o travel in bf16/fp16 whatever the cache dtype is
GB = 10**9  # --gpu-memory-gb is decimal, like the memory torch reports (hardware.Hardware.memory_gb)


def kv_bytes_per_token_per_layer(shape: AttentionShape, kv_dtype: str = "bf16") -> int:
    """Cache bytes one token adds in one layer.

    MHA/GQA: num_kv_heads * (head_dim + v_head_dim) * dtype_bytes  (a K row and a V row per KV head).
    MLA:     (kv_lora_rank + qk_rope_head_dim) * dtype_bytes  (one latent row; V is a view of it).
    FP8 per-layer scales are two scalars per layer, not per token, so they do not count.
    The one formula for it: the engine sizes its pool with it, and the pools' own `bytes_per_token`
    (measured from their buffers) is tested against it.
    """
    b = dtype_bytes(kv_dtype)
    if shape.attention_type == "MLA":
        return (shape.kv_lora_rank + shape.qk_rope_head_dim) * b
    return shape.num_kv_heads * (shape.head_dim + shape.v_head_dim) * b


def kv_bytes_per_token(shape: AttentionShape, kv_dtype: str = "bf16") -> int:
    """Cache bytes per token over the whole model: num_layers * the per-layer figure.

    Llama-2-7B (32 layers, 32 KV heads of 128, bf16): 32 * 32 * 256 * 2 = 512 KiB.
    DeepSeek-V2 (60 layers, latent 512 + rope 64, bf16): 60 * 576 * 2 = 67.5 KiB.
    """
    return shape.num_layers * kv_bytes_per_token_per_layer(shape, kv_dtype)


def kv_cache_bytes(shape: AttentionShape, context: int, batch: int, kv_dtype: str = "bf16") -> int:
    """Cache for `batch` requests of `context` tokens each: batch * context * bytes_per_token."""
    _check_positive(context=context, batch=batch)
    return batch * context * kv_bytes_per_token(shape, kv_dtype)


def weight_bytes(shape: AttentionShape, weight_dtype: str = "bf16") -> int:
    """Weights in memory: the estimated parameter count times bytes per weight."""
    return int(shape.num_params * _weight_dtype_bytes(weight_dtype))


def max_batch(
    shape: AttentionShape, context: int, gpu_memory_bytes: int, kv_dtype: str = "bf16", weight_dtype: str = "bf16"
) -> int:
    """Requests of `context` tokens whose cache fits beside the weights:

        floor((gpu_memory - weight_bytes) / (context * bytes_per_token)), and 0 when the weights alone do not fit.

    Activations, CUDA graphs and allocator slack are not subtracted, so this is an upper bound.
    """
    _check_positive(context=context, gpu_memory_bytes=gpu_memory_bytes)
    free = gpu_memory_bytes - weight_bytes(shape, weight_dtype)
    if free <= 0:
        return 0
    return free // (context * kv_bytes_per_token(shape, kv_dtype))


def attention_flops_per_query(shape: AttentionShape, num_keys: int) -> int:
    """FLOPs for one query token over `num_keys` keys in one layer: 2 * Hq * num_keys * (head_dim + v_head_dim).

    The first term is q.k (a multiply-add per K element per query head), the second p.v. For MLA this is
    the absorbed form: every query head reads the 576-wide latent as K and its first 512 columns as V.
    """
    return 2 * shape.num_q_heads * num_keys * (shape.head_dim + shape.v_head_dim)


def decode_intensity(shape: AttentionShape, context: int, kv_dtype: str = "bf16") -> float:
    """Attention FLOPs per byte moved in one decode step (per layer; the same for any batch size).

    FLOPs: attention_flops_per_query(shape, context).
    Bytes: the request's whole cache for the layer (context * per-layer bytes per token) plus the query
    and output rows (Hq * (head_dim + v_head_dim) * 2). Each request reads only its own cache, so
    batching does not raise it; it is about 2 * (Hq / Hkv) / dtype_bytes for GQA (1 for bf16 MHA, 8 for
    GQA-8) and several hundred for MLA, whose single latent head serves every query head.
    """
    _check_positive(context=context)
    flops = attention_flops_per_query(shape, context)
    moved = context * kv_bytes_per_token_per_layer(shape, kv_dtype) + _qo_bytes(shape, 1)
    return flops / moved


def prefill_intensity(shape: AttentionShape, context: int, kv_dtype: str = "bf16") -> float:
    """Attention FLOPs per byte for prefilling `context` tokens with no cached prefix (causal, per layer).

    FLOPs: query i sees i + 1 keys, so the total is attention_flops_per_query summed over
    i = 0..context-1 = 2 * Hq * (head_dim + v_head_dim) * context * (context + 1) / 2.
    Bytes: the minimum an IO-aware kernel moves — Q in, O out (context rows each) and the new K/V
    written to and read from the cache once. It grows linearly with context: prefill is compute-bound.
    """
    _check_positive(context=context)
    flops = 2 * shape.num_q_heads * (shape.head_dim + shape.v_head_dim) * context * (context + 1) // 2
    moved = 2 * context * kv_bytes_per_token_per_layer(shape, kv_dtype) + _qo_bytes(shape, context)
    return flops / moved


def decode_step_intensity(
    shape: AttentionShape, context: int, batch: int, kv_dtype: str = "bf16", weight_dtype: str = "bf16"
) -> float | None:
    """Whole-model FLOPs per byte of one decode step for `batch` requests (None without a parameter count).

    FLOPs: 2 * active_params * batch (the matmuls) + num_layers * batch * attention_flops_per_query.
    Bytes: every weight once (active experts only for MoE, an optimistic lower bound) + every request's cache.
    Batching raises it until the cache reads dominate the weight reads.
    """
    _check_positive(context=context, batch=batch)
    if not shape.num_active_params:
        return None
    flops = 2 * shape.num_active_params * batch + shape.num_layers * batch * attention_flops_per_query(shape, context)
    moved = shape.num_active_params * _weight_dtype_bytes(weight_dtype) + kv_cache_bytes(shape, context, batch, kv_dtype)
    return flops / moved


@dataclass(frozen=True)
class KVCacheReport:
    """Every number `attnserve kv-calc` prints; `as_dict()` is its --json output."""

    model: str
    attention_type: str
    kv_cache_dtype: str
    weight_dtype: str
    context: int
    batch: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    sliding_window: int | None
    bytes_per_token_per_layer: int
    bytes_per_token: int
    bytes_per_request: int
    total_bytes: int
    num_params: int
    weight_bytes: int
    decode_intensity: float
    prefill_intensity: float
    decode_step_intensity: float | None
    gpu_memory_bytes: int | None = None
    max_batch: int | None = None
    tp_size: int = 1  # > 1: every per-token, cache and weight figure is one tensor-parallel rank's

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.gpu_memory_bytes is None:
            del d["gpu_memory_bytes"], d["max_batch"]
        if self.tp_size == 1:
            del d["tp_size"]
        return d


# the rank's own figures, which the report repeats as they are
_SHAPE_FIELDS = ("attention_type", "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "v_head_dim",
                 "sliding_window", "num_params")


def kv_cache_report(
    model: str,
    shape: AttentionShape,
    context: int,
    batch: int,
    kv_dtype: str = "bf16",
    gpu_memory_gb: float | None = None,
    weight_dtype: str = "bf16",
    tp_size: int = 1,
    stated_dtype: str | None = None,
) -> KVCacheReport:
    """All the calculator's numbers for one model, context and batch; with tp_size > 1, for one rank
    (its heads' cache, its share of the weights, its GPU's memory): what the engine's start-up log reports.

    kv_dtype / weight_dtype "auto": what the engine runs on a GPU (attnserve.dtypes.resolve_dtypes), the
    KV cache and the weights in the model dtype, the one the checkpoint states (`stated_dtype`), bf16 if none.
    """
    _check_positive(context=context, batch=batch)
    shape = shape.per_rank(tp_size)
    auto = resolve_dtypes("cuda", False, "auto", kv_dtype, stated_dtype)
    kv_dtype = auto.kv_cache
    if weight_dtype == "auto":
        weight_dtype = auto.model_name
    _weight_dtype_bytes(weight_dtype)
    mem = None
    fits = None
    if gpu_memory_gb is not None:
        _check_positive(gpu_memory_gb=gpu_memory_gb)
        mem = int(gpu_memory_gb * GB)
        fits = max_batch(shape, context, mem, kv_dtype, weight_dtype)
    bpt = kv_bytes_per_token(shape, kv_dtype)
    return KVCacheReport(
        model=model,
        kv_cache_dtype=kv_dtype,
        weight_dtype=weight_dtype,
        context=context,
        batch=batch,
        **{name: getattr(shape, name) for name in _SHAPE_FIELDS},
        bytes_per_token_per_layer=kv_bytes_per_token_per_layer(shape, kv_dtype),
        bytes_per_token=bpt,
        bytes_per_request=bpt * context,
        total_bytes=kv_cache_bytes(shape, context, batch, kv_dtype),
        weight_bytes=weight_bytes(shape, weight_dtype),
        decode_intensity=decode_intensity(shape, context, kv_dtype),
        prefill_intensity=prefill_intensity(shape, context, kv_dtype),
        decode_step_intensity=decode_step_intensity(shape, context, batch, kv_dtype, weight_dtype),
        gpu_memory_bytes=mem,
        max_batch=fits,
        tp_size=tp_size,
    )


def format_bytes(n: float) -> str:
    """Binary units, as KV sizes are usually quoted (512 KiB, 2 GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or float(n).is_integer() else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _qo_bytes(shape: AttentionShape, tokens: int) -> int:
    return tokens * shape.num_q_heads * (shape.head_dim + shape.v_head_dim) * ACTIVATION_BYTES


def _weight_dtype_bytes(name: str) -> float:
    try:
        return WEIGHT_DTYPE_BYTES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown weight dtype {name!r}; allowed: {', '.join(WEIGHT_DTYPE_BYTES)}") from None


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")


__all__ = [
    "KVCacheReport", "decode_intensity", "decode_step_intensity", "format_bytes", "kv_bytes_per_token",
    "kv_bytes_per_token_per_layer", "kv_cache_bytes", "kv_cache_report", "max_batch", "prefill_intensity",
    "weight_bytes",
]
