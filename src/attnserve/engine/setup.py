"""Engine start-up: load the model, resolve the attention backend, size the KV pool, capture graphs.

Everything decided here is logged once at start-up (model, device, dtype, pool
size in tokens and GB, page size, the backends and why, CUDA-graph sizes), so a
user can see what is running without reading code.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

from attnserve.engine.config import EngineConfig
from attnserve.kvcache.allocator import PageAllocator
from attnserve.kvcache.dtypes import canonical_kv_dtype, dtype_bytes
from attnserve.kvcache.pool import KVPool, ReqToTokenPool

log = logging.getLogger("attnserve.engine")

CPU_DEFAULT_POOL_TOKENS = 32768
MAX_DEFAULT_CONTEXT = 32768


@dataclass
class EngineParts:
    model: torch.nn.Module
    tokenizer: object | None
    eos_token_ids: list[int]
    chat_template: str | None
    device: torch.device
    dtype: torch.dtype
    pool: KVPool
    allocator: PageAllocator
    req_pool: ReqToTokenPool
    padding_row: int
    backend: object
    prefill_backend: str
    decode_backend: str
    selection_trace: list[str] = field(default_factory=list)
    graph_runner: object | None = None
    graph_batch_sizes: list[int] = field(default_factory=list)
    vocab_size: int | None = None
    model_name: str = ""
    loaded: object | None = None
    startup_lines: list[str] = field(default_factory=list)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available here; use --device cpu")
    if dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ValueError(f"device {name!r} requested but this torch build has no usable MPS; use --device cpu")
    return dev


def load_bundle(config: EngineConfig, device: torch.device):
    from attnserve.models.loader import load_model

    # the loader resolves "auto" with the checkpoint's own dtype in hand
    return load_model(config.model, dtype=config.dtype, device=device, random_weights=config.random_weights,
                      seed=config.seed)


def _hf_model_type(hf_config: dict) -> str:
    """model_type of a config that lacks it (a GGUF file names only the architecture)."""
    from attnserve.models.config import _MODEL_TYPE_TO_ARCH

    archs = hf_config.get("architectures") or []
    by_arch = {arch: model_type for model_type, arch in _MODEL_TYPE_TO_ARCH.items()}
    return by_arch.get(archs[0], "") if archs else ""


def selection_traits(loaded, spec):
    """The ModelTraits `attnserve select --model config.json` would build for this model.

    Built from the model's HF config dict the same way, so the engine and `select` decide alike
    (sinks, soft-cap and model_type included). A bundle without one falls back to the KV spec.
    """
    from attnserve.attention.selection import ModelTraits
    from attnserve.presets import AttentionShape

    hf_config = getattr(loaded, "hf_config", None)
    if isinstance(hf_config, dict):
        if "num_hidden_layers" not in hf_config and isinstance(hf_config.get("text_config"), dict):
            hf_config = {**hf_config["text_config"], "architectures": hf_config.get("architectures", [])}
        if not hf_config.get("model_type"):
            hf_config = {**hf_config, "model_type": _hf_model_type(hf_config)}
        shape = AttentionShape.from_config(hf_config, with_params=False)
        return ModelTraits.from_shape(shape, 1, name=str(getattr(loaded, "source", "") or ""))
    return ModelTraits(
        attention_type=spec.attention_type,
        num_heads=spec.num_q_heads or spec.num_kv_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        v_head_dim=spec.v_head_dim,
        sliding_window=spec.sliding_window is not None,
    )


def _loaded_dtype(loaded, fallback: torch.dtype) -> torch.dtype:
    """The dtype the model really has ("auto" is only decided once the checkpoint is read)."""
    if isinstance(getattr(loaded, "dtype", None), torch.dtype):
        return loaded.dtype
    for p in loaded.model.parameters():
        if p.is_floating_point():
            return p.dtype
    return fallback


def hardware_for(device: torch.device):
    """This machine as the selection sees it, on the device the engine was told to use."""
    from dataclasses import replace

    from attnserve.hardware import detect_hardware

    hw = detect_hardware()
    runs_on = "rocm" if device.type == "cuda" and hw.device == "rocm" else device.type
    if runs_on != hw.device:  # e.g. --device cpu on a GPU machine
        hw = replace(hw, device=runs_on, compute_capability=None, name=runs_on)
    return hw


def _select(config: EngineConfig, traits, kv_dtype: str, hw):
    from attnserve.attention.selection import ServingFeatures, select_backends

    serving = ServingFeatures(page_size=config.page_size, kv_cache_dtype=kv_dtype)
    return select_backends(hw, traits, serving, attention_backend=config.attention_backend,
                           prefill_backend=config.prefill_attention_backend,
                           decode_backend=config.decode_attention_backend)


def _use_ops(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, config: EngineConfig):
    """Pick the model's non-attention ops once, before any graph is captured (fused Triton on CUDA)."""
    from attnserve.models.layers import use_ops
    from attnserve.ops import select_ops

    ops = select_ops(device, fused=not config.disable_fused_ops, dtype=dtype)
    use_ops(model, ops)
    return ops


def _pool_tokens(config: EngineConfig, bytes_per_token: int, device: torch.device, max_tokens_needed: int) -> int:
    if config.max_total_tokens is not None:
        return config.max_total_tokens
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        usable = free - (1 - config.mem_fraction_static) * total
        tokens = int(usable // bytes_per_token)
        if tokens < 1:
            raise ValueError(f"no GPU memory left for the KV cache (free {free / 2**30:.1f} GiB); "
                             "raise --mem-fraction-static or set --max-total-tokens")
    else:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 8 * 2**30
        tokens = min(CPU_DEFAULT_POOL_TOKENS, int(avail * 0.25 // bytes_per_token))
    return max(1, min(tokens, max_tokens_needed))


def build_parts(config: EngineConfig, loaded=None) -> EngineParts:
    t0 = time.perf_counter()
    from attnserve.attention.hybrid import build_backend
    from attnserve.models.loader import resolve_dtype

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)  # a bad name fails before any loading
    if loaded is None:
        loaded = load_bundle(config, device)
    model = loaded.model
    dtype = _loaded_dtype(loaded, dtype)
    ops = _use_ops(model, device, dtype, config)
    load_s = time.perf_counter() - t0
    spec = model.kv_cache_spec()
    kv_dtype = canonical_kv_dtype(dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype)

    hw = hardware_for(device)
    selection = _select(config, selection_traits(loaded, spec), kv_dtype, hw)
    prefill, decode, page_size = selection.prefill_backend, selection.decode_backend, selection.page_size
    trace, graph_ok = [str(e) for e in selection.trace], selection.cuda_graph

    model_ctx = getattr(getattr(model, "config", None), "max_position_embeddings", None) or MAX_DEFAULT_CONTEXT
    max_ctx = config.max_context_len or min(int(model_ctx), MAX_DEFAULT_CONTEXT)
    bpt = spec.bytes_per_token(dtype_bytes(kv_dtype))
    tokens = _pool_tokens(config, bpt, device, config.max_running_requests * max_ctx)
    num_pages = max(2, -(-tokens // page_size) + 1)  # + the padding page
    pool = spec.make_pool(num_pages, page_size, dtype=kv_dtype, device=device)
    allocator = PageAllocator(num_pages)
    req_pool = ReqToTokenPool(config.max_running_requests + 1, max_ctx, device=device)
    padding_row = req_pool.alloc()  # all zeros: every slot is slot 0 of the padding page
    backend = build_backend(selection, pool, hw)

    parts = EngineParts(
        model=model, tokenizer=getattr(loaded, "tokenizer", None),
        eos_token_ids=list(getattr(loaded, "eos_token_ids", []) or []),
        chat_template=getattr(loaded, "chat_template", None), device=device, dtype=dtype, pool=pool,
        allocator=allocator, req_pool=req_pool, padding_row=padding_row, backend=backend,
        prefill_backend=prefill, decode_backend=decode, selection_trace=trace,
        vocab_size=getattr(getattr(model, "config", None), "vocab_size", None),
        model_name=str(getattr(loaded, "source", None) or getattr(loaded, "name", None) or config.model
                       or "embedded SmolLM2-135M-Instruct")
        + ("  [RANDOM WEIGHTS]" if getattr(loaded, "random_weights", False) else ""),
        loaded=loaded,
    )
    graph_note = "off (CPU)" if device.type != "cuda" else "off (--disable-cuda-graph)"
    if device.type == "cuda" and not config.disable_cuda_graph:
        if not graph_ok or not backend.features.cuda_graph:
            graph_note = f"off ({decode} cannot be captured; decode runs eagerly)"
        else:
            from attnserve.engine.cuda_graph import CudaGraphRunner, default_batch_sizes

            max_bs = min(config.cuda_graph_max_bs or 128, config.max_running_requests)
            sizes = default_batch_sizes(max_bs)
            runner = CudaGraphRunner(model, backend, pool, req_pool, padding_row, sizes, device)
            secs = runner.capture()
            parts.graph_runner, parts.graph_batch_sizes = runner, sizes
            graph_note = f"batch sizes {sizes} (captured in {secs:.1f} s)"
    pool_gb = num_pages * page_size * bpt / 1e9
    parts.startup_lines = [
        f"model: {parts.model_name} ({type(model).__name__}, load {load_s:.1f} s)",
        f"device: {device}   dtype: {str(dtype).replace('torch.', '')}   KV dtype: {kv_dtype}",
        (f"KV pool: {(num_pages - 1) * page_size} tokens, {pool_gb:.2f} GB, page size {page_size}, "
        f"{spec.num_layers} layers x {spec.num_kv_heads} KV heads x {spec.head_dim} dim"),
        f"attention: prefill {prefill}, decode {decode}",
        f"fused ops: {ops.describe()}",
        *[f"  {line}" for line in trace],
        f"CUDA graphs: {graph_note}",
        (f"scheduler: max running {config.max_running_requests}, context {max_ctx}, chunked prefill "
        f"{config.chunked_prefill_size or 'off'}, radix cache {'off' if config.disable_radix_cache else 'on'}"),
    ]
    for line in parts.startup_lines:
        log.info(line)
    return parts
