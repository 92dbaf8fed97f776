"""Engine start-up: load the model, choose the attention backends, size the KV cache, capture graphs.

Each step is a function with a small typed result, and `build_parts` runs them in order:

    load_model_setup  -> ModelSetup      the model, its tokenizer and dtype
    choose_attention  -> AttentionChoice what `attnserve select` would pick for this model and device
    size_kv_cache     -> KVCacheSetup    the KV pool, its page allocator and the request->slot table
    build_graphs      -> GraphSetup      decode CUDA graphs (or why there are none), piecewise ones if asked

Everything decided here is logged once at start-up (model, device, dtype, pool
size in tokens and GB, page size, the backends and why, CUDA-graph sizes), so a
user can see what is running without reading code.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, replace

import torch

from attnserve.choice.registry import build_backend
from attnserve.choice.selection import ServingFeatures, select_backends
from attnserve.distributed.state import min_over_ranks, parallel_state
from attnserve.dtypes import Dtypes, resolve_dtypes
from attnserve.engine.config import EngineConfig
from attnserve.engine.cuda_graph import CudaGraphRunner, default_batch_sizes, verify_batch_sizes
from attnserve.engine.piecewise_graph import PiecewiseGraphRunner, default_token_sizes, model_can_be_cut
from attnserve.engine.schedule_policy import StepBudget, resolve_step_budget
from attnserve.hardware import cpu_has_hardware_bf16, detect_hardware
from attnserve.kvcache.allocator import PageAllocator
from attnserve.kvcache.calc import kv_bytes_per_token
from attnserve.kvcache.pool import KVPool, ReqToTokenPool, make_pool
from attnserve.models import cpu_weights
from attnserve.models.layers import use_ops
from attnserve.models.loader import load_model, resolve_dtype
from attnserve.ops import select_ops

log = logging.getLogger("attnserve.engine")

CPU_DEFAULT_POOL_TOKENS = 32768
MAX_DEFAULT_CONTEXT = 32768


@dataclass
class ModelSetup:
    """The model as loaded, with what the engine needs from its bundle."""

    module: torch.nn.Module
    tokenizer: object | None
    eos_token_ids: list[int]
    chat_template: str | None
    device: torch.device
    dtype: torch.dtype
    vocab_size: int | None
    name: str  # for the start-up log
    load_seconds: float
    weights_note: str  # how the projection weights are held (models.cpu_weights), for the start-up log
    bundle: object  # as the loader returned it (hf_config, source, ...)


@dataclass(frozen=True)
class AttentionChoice:
    """The selection's decision for this model on this device."""

    prefill_backend: str
    decode_backend: str
    page_size: int
    kv_dtype: str
    trace: list[str]  # why, one line per decision
    graph_capturable: bool  # the selection allows capturing decode in CUDA graphs
    selection: object  # the full selection result, which builds the backend
    hardware: object


@dataclass(frozen=True)
class KVCacheSetup:
    pool: KVPool
    allocator: PageAllocator
    req_pool: ReqToTokenPool
    padding_row: int  # request->slot row of all zeros, for padded CUDA-graph rows
    max_context_len: int
    bytes_per_token: int


@dataclass(frozen=True)
class GraphSetup:
    runner: object | None  # a captured CudaGraphRunner, or None when decode runs eagerly
    batch_sizes: list[int]
    note: str  # the start-up log's "CUDA graphs:" line
    piecewise: object | None = None  # a captured PiecewiseGraphRunner for prompt-carrying steps, or None


@dataclass(frozen=True)
class EngineParts:
    model: ModelSetup
    attention: AttentionChoice
    backend: object  # the attention backend built from `attention` over `kv.pool`
    kv: KVCacheSetup
    graphs: GraphSetup
    startup_lines: list[str]
    step_budget: StepBudget  # prompt tokens a step that decodes may add (the scheduler's)


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
    # the loader resolves "auto" with the checkpoint's own dtype in hand
    return load_model(config.model, dtype=config.dtype, device=device, random_weights=config.random_weights,
                      seed=config.seed)


def model_shape(loaded):
    """The shape the pool is built from and selection checks: the model's `kv_cache_spec()` (its parsed
    config through `models.config.attention_shape_of`, as `attnserve select --model` resolves it), named as
    the log names the model, so the engine and `select` decide alike."""
    return replace(loaded.model.kv_cache_spec(), name=str(getattr(loaded, "source", "") or ""))


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
    hw = detect_hardware()
    runs_on = "rocm" if device.type == "cuda" and hw.device == "rocm" else device.type
    if runs_on != hw.device:  # e.g. --device cpu on a GPU machine
        hw = replace(hw, device=runs_on, compute_capability=None, name=runs_on)
    return hw


def _select(config: EngineConfig, traits, kv_dtype: str, hw, dtypes: str = ""):
    """dtypes: how the model and KV dtypes were resolved, for the trace (attnserve.dtypes.Dtypes.describe)."""
    serving = ServingFeatures(page_size=config.page_size, kv_cache_dtype=kv_dtype,
                              speculative_topk=config.speculative_topk, dtypes=dtypes,
                              deterministic=config.enable_deterministic_inference)
    return select_backends(hw, traits, serving, attention_backend=config.attention_backend,
                           prefill_backend=config.prefill_attention_backend,
                           decode_backend=config.decode_attention_backend, use_tuned=not config.no_tuned,
                           speculative_attention_mode=config.speculative_attention_mode)


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


def _use_ops(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, config: EngineConfig) -> None:
    """Pick the model's non-attention ops once, before any graph is captured (fused Triton on CUDA)."""
    use_ops(model, select_ops(device, fused=not config.disable_fused_ops, dtype=dtype, pdl=config.enable_pdl))


def _ops_note(model: torch.nn.Module) -> str:
    ops = getattr(model, "ops", None)
    return ops.describe() if ops is not None else "n/a (this model runs its own ops)"


def load_model_setup(config: EngineConfig, loaded=None) -> ModelSetup:
    """Load `config.model` (or take the bundle already loaded) and check the dtype asked for is the one it has."""
    t0 = time.perf_counter()
    device = resolve_device(config.device)
    requested = resolve_dtype(config.dtype, device)  # a bad name fails before any loading
    given = loaded is not None
    if loaded is None:
        loaded = load_bundle(config, device)
    model = loaded.model
    dtype = _loaded_dtype(loaded, requested)
    if config.dtype != "auto" and dtype != requested:
        where = "the model passed in was already loaded" if given else "the loader gave"
        raise ValueError(f"dtype {config.dtype!r} ({_dtype_name(requested)}) cannot be honoured: {where} "
                         f"{_dtype_name(dtype)}; load it as {_dtype_name(requested)}, or pass dtype='auto'")
    _use_ops(model, device, dtype, config)
    if device.type == "cpu" and config.cpu_threads is not None:
        torch.set_num_threads(config.cpu_threads)
    weights_note = _pack_weights(model, loaded, config)
    name = str(getattr(loaded, "source", None) or getattr(loaded, "name", None) or config.model
               or "embedded SmolLM2-135M-Instruct")
    return ModelSetup(
        module=model, tokenizer=getattr(loaded, "tokenizer", None),
        eos_token_ids=list(getattr(loaded, "eos_token_ids", []) or []),
        chat_template=getattr(loaded, "chat_template", None), device=device, dtype=dtype,
        vocab_size=getattr(getattr(model, "config", None), "vocab_size", None),
        name=name + ("  [RANDOM WEIGHTS]" if getattr(loaded, "random_weights", False) else ""),
        load_seconds=time.perf_counter() - t0, bundle=loaded, weights_note=weights_note,
    )


def _pack_weights(model: torch.nn.Module, loaded, config: EngineConfig) -> str:
    """The CPU weight format (once per model: a bundle shared by several engines is packed by the first,
    and the others must ask for the same format, deterministic or not)."""
    deterministic = config.enable_deterministic_inference
    done = getattr(model, "_weights_note", None)
    if done is not None:
        asked = getattr(model, "_weights_asked", "auto")
        if config.weights_dtype not in ("auto", asked):
            raise ValueError(f"weights_dtype {config.weights_dtype!r}: this model was already packed as "
                             f"{done}; load it again to hold its weights another way")
        if getattr(model, "_weights_deterministic", False) != deterministic:
            mode = "deterministic" if model._weights_deterministic else "default"
            raise ValueError(f"enable_deterministic_inference={deterministic}: this model's weights are already "
                             f"set up for {mode} inference by another engine; load it again for this one")
        return done
    note = cpu_weights.pack_cpu_weights(model, loaded, config.weights_dtype)
    if deterministic:
        invariant = cpu_weights.make_batch_invariant(model)
        note += f"; {invariant}" if invariant else ""
    model._weights_note, model._weights_asked = note, config.weights_dtype
    model._weights_deterministic = deterministic
    return note


def _threads_note(config: EngineConfig) -> str:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    why = "--cpu-threads" if config.cpu_threads else "torch's default"
    return f"cpu threads: {torch.get_num_threads()} ({why}; {usable} usable CPUs)"


def _dtype_note(config: EngineConfig, model: ModelSetup) -> str:
    if config.dtype != "auto" or model.device.type != "cpu":
        return ""
    auto = resolve_dtypes("cpu", cpu_has_hardware_bf16())
    return f" ({auto.model_reason})" if auto.model == model.dtype else ""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def resolved_dtypes(config: EngineConfig, model: ModelSetup, hw) -> Dtypes:
    """--dtype and --kv-cache-dtype resolved as `attnserve select` resolves them (the loader built the model so);
    a model passed in already loaded in another dtype keeps its own."""
    stated = getattr(model.bundle, "stated_dtype", None)
    dtypes = resolve_dtypes(model.device.type, hw.cpu_bf16, config.dtype, config.kv_cache_dtype, stated)
    if dtypes.model != model.dtype:
        dtypes = resolve_dtypes(model.device.type, hw.cpu_bf16, model.dtype, config.kv_cache_dtype)
    return dtypes


def choose_attention(config: EngineConfig, model: ModelSetup) -> AttentionChoice:
    """Decide the backends as `attnserve select` would, on the device the engine was told to use."""
    hw = hardware_for(model.device)
    dtypes = resolved_dtypes(config, model, hw)
    kv_dtype = dtypes.kv_cache
    traits = model_shape(model.bundle)
    selection = _select(config, traits, kv_dtype, hw, dtypes.describe())
    return AttentionChoice(
        prefill_backend=selection.prefill_backend, decode_backend=selection.decode_backend,
        page_size=selection.page_size, kv_dtype=kv_dtype, trace=[str(e) for e in selection.trace],
        graph_capturable=selection.cuda_graph, selection=selection, hardware=hw,
    )


def size_kv_cache(config: EngineConfig, model: ModelSetup, attention: AttentionChoice) -> KVCacheSetup:
    """The KV pool (from the memory left, or --max-total-tokens), its allocator and the request->slot table."""
    spec = model.module.kv_cache_spec()
    page_size = attention.page_size
    model_ctx = getattr(getattr(model.module, "config", None), "max_position_embeddings", None) or MAX_DEFAULT_CONTEXT
    max_ctx = config.max_context_len or min(int(model_ctx), MAX_DEFAULT_CONTEXT)
    bpt = kv_bytes_per_token(spec, attention.kv_dtype)
    # every tensor-parallel rank sizes from its own free memory; all must hold the same pages
    tokens = min_over_ranks(_pool_tokens(config, bpt, model.device, config.max_running_requests * max_ctx))
    num_pages = max(2, -(-tokens // page_size) + 1)  # + the padding page
    pool = make_pool(spec, num_pages, page_size, dtype=attention.kv_dtype, device=model.device)
    req_pool = ReqToTokenPool(config.max_running_requests + 1, max_ctx, device=model.device)
    padding_row = req_pool.alloc()  # all zeros: every slot is slot 0 of the padding page
    return KVCacheSetup(pool=pool, allocator=PageAllocator(num_pages), req_pool=req_pool, padding_row=padding_row,
                        max_context_len=max_ctx, bytes_per_token=bpt)


def build_graphs(config: EngineConfig, model: ModelSetup, attention: AttentionChoice, backend,
                 kv: KVCacheSetup, step_budget: StepBudget | None = None) -> GraphSetup:
    """Capture decode CUDA graphs when on CUDA, allowed, and the decode backend can be captured; then the
    piecewise graphs of prompt-carrying steps unless `piecewise_off_reason` says why not."""
    if model.device.type != "cuda":
        return GraphSetup(None, [], "off (CPU)")
    if config.disable_cuda_graph:
        return GraphSetup(None, [], "off (--disable-cuda-graph)")
    decode = _decode_graphs(config, model, attention, backend, kv)
    why = piecewise_off_reason(config, model)
    if why is not None:
        return dataclasses.replace(decode, note=f"{decode.note}; piecewise off ({why})")
    piecewise, note = _piecewise_graphs(config, model, backend, kv, step_budget)
    return dataclasses.replace(decode, note=f"{decode.note}; piecewise {note}", piecewise=piecewise)


def piecewise_off_reason(config: EngineConfig, model: ModelSetup) -> str | None:
    """Why prompt-carrying steps run eagerly here (None: they replay piecewise graphs). Known before the
    capture, since the GPU's default step budget depends on it."""
    if model.device.type != "cuda":
        return "CPU"
    if config.disable_cuda_graph:
        return "--disable-cuda-graph"
    if config.disable_piecewise_cuda_graph:
        return "--disable-piecewise-cuda-graph"
    if config.enable_deterministic_inference:  # a bucket's padded row count would depend on the step's company
        return "--enable-deterministic-inference: the padded size depends on the other requests"
    return model_can_be_cut(model.module)


def piecewise_max_tokens(config: EngineConfig, step_budget: StepBudget | None) -> int:
    """The largest step captured in pieces: the flag, else a fixed step budget (every step that decodes fits),
    else 2048."""
    if config.piecewise_cuda_graph_max_tokens:
        return config.piecewise_cuda_graph_max_tokens
    if step_budget is not None and step_budget.kind == "fixed":
        return step_budget.tokens
    return 2048


def _piecewise_graphs(config: EngineConfig, model: ModelSetup, backend, kv: KVCacheSetup,
                      step_budget: StepBudget | None) -> tuple[object | None, str]:
    """(the captured piecewise runner, what the start-up log says of it)."""
    sizes = default_token_sizes(piecewise_max_tokens(config, step_budget))
    runner = PiecewiseGraphRunner(model.module, backend, kv.pool, kv.req_pool, kv.padding_row, sizes, model.device,
                                  model.dtype)
    secs = runner.capture()
    return runner, f"token sizes {sizes[0]}..{sizes[-1]} ({len(sizes)} of them, captured in {secs:.1f} s)"


def _decode_graphs(config: EngineConfig, model: ModelSetup, attention: AttentionChoice, backend,
                   kv: KVCacheSetup) -> GraphSetup:
    if not attention.graph_capturable or not backend.features.cuda_graph:
        return GraphSetup(None, [], f"off ({attention.decode_backend} cannot be captured; decode runs eagerly)")
    max_bs = min(config.cuda_graph_max_bs or 128, config.max_running_requests)
    sizes = default_batch_sizes(max_bs)
    speculative = bool(getattr(config, "speculative_algorithm", None))
    max_tokens = 0
    if speculative:  # the backend hears of the largest verify step before the first capture, where it sizes
        q, verify_sizes = verify_graph_shape(config, sizes)  # scratch the graphs keep (FlashInfer's workspace)
        max_tokens = q * verify_sizes[-1]
    runner = CudaGraphRunner(model.module, backend, kv.pool, kv.req_pool, kv.padding_row, sizes, model.device,
                             max_tokens=max_tokens)
    secs = runner.capture()
    note = f"batch sizes {sizes} (captured in {secs:.1f} s)"
    if speculative:
        note += "; " + _capture_verify_graphs(config, runner, sizes)
    return GraphSetup(runner, sizes, note)


def verify_graph_shape(config: EngineConfig, sizes: list[int]) -> tuple[int, list[int]]:
    """(q = 1 + draft tokens a request, the batch sizes of the verify graphs) for decode graphs of these sizes."""
    q = 1 + int(getattr(config, "speculative_num_draft_tokens", None) or 0)
    return q, verify_batch_sizes(sizes, q)


def _capture_verify_graphs(config: EngineConfig, runner: CudaGraphRunner, sizes: list[int]) -> str:
    """Verify graphs of q = 1 + draft tokens per request: chains, and trees when the draft tree branches."""
    q, verify_sizes = verify_graph_shape(config, sizes)
    kinds = [False] + ([True] if (getattr(config, "speculative_eagle_topk", None) or 1) > 1 else [])
    parts = []
    for tree in kinds:
        kind = "tree" if tree else "chain"
        try:
            parts.append(f"{kind} captured in {runner.capture_verify(q, tree, verify_sizes):.1f} s")
        except (NotImplementedError, ValueError, torch.cuda.OutOfMemoryError) as exc:  # then it runs eagerly
            parts.append(f"{kind} eager ({exc})")
    return f"verify {q} tokens a request at batch sizes {verify_sizes}: {', '.join(parts)}"


def startup_lines(config: EngineConfig, model: ModelSetup, attention: AttentionChoice, kv: KVCacheSetup,
                  graphs: GraphSetup, step_budget: StepBudget) -> list[str]:
    """What the engine runs, in the words the start-up log prints."""
    spec = model.module.kv_cache_spec()
    pool = kv.pool
    tp = parallel_state().size
    per_rank = f" per tensor-parallel rank (tp {tp})" if tp > 1 else ""
    pool_gb = pool.num_pages * pool.page_size * kv.bytes_per_token / 1e9
    return [
        f"model: {model.name} ({type(model.module).__name__}, load {model.load_seconds:.1f} s)",
        (f"device: {model.device}   dtype: {_dtype_name(model.dtype)}{_dtype_note(config, model)}   "
         f"KV dtype: {attention.kv_dtype}"),
        f"weights: {model.weights_note}",
        *([_threads_note(config)] if model.device.type == "cpu" else []),
        (f"KV pool: {(pool.num_pages - 1) * pool.page_size} tokens, {pool_gb:.2f} GB{per_rank}, page size "
         f"{pool.page_size}, {spec.num_layers} layers x {spec.num_kv_heads} KV heads x {spec.head_dim} dim"),
        f"attention: prefill {attention.prefill_backend}, decode {attention.decode_backend}",
        *[f"  {line}" for line in attention.trace],
        f"fused ops: {_ops_note(model.module)}",
        f"CUDA graphs: {graphs.note}",
        f"speculative decoding: {_speculative_note(config, attention)}",
        (f"scheduler: max running {config.max_running_requests}, context {kv.max_context_len}, chunked prefill "
         f"{config.chunked_prefill_size or 'off'}, radix cache {'off' if config.disable_radix_cache else 'on'}"),
        f"step budget: {step_budget.describe(_chunk(config))}",
    ]


def _chunk(config: EngineConfig) -> int | None:
    c = config.chunked_prefill_size
    return c if c is not None and c > 0 else None


def verify_backend(config: EngineConfig, attention: AttentionChoice) -> str:
    """The backend that runs verify steps: the prefill one unless --speculative-attention-mode decode."""
    return attention.decode_backend if config.speculative_attention_mode == "decode" else attention.prefill_backend


def _speculative_note(config: EngineConfig, attention: AttentionChoice) -> str:
    if config.speculative_algorithm is None:
        return "off"
    k = config.speculative_num_draft_tokens
    topk = config.speculative_eagle_topk
    depth = config.speculative_num_steps or k
    shape = (f"a chain of up to {min(k, depth)} drafts" if topk == 1
             else f"a tree of up to {k} drafts, {topk} continuations merged, depth <= {depth}")
    return (f"{config.speculative_algorithm} (prompt lookup, match windows "
            f"{config.speculative_ngram_max_match_window_size}..{config.speculative_ngram_min_match_window_size} "
            f"tokens, longest first), {shape} per request per step; verify on {verify_backend(config, attention)} "
            f"(speculative attention mode {config.speculative_attention_mode}"
            f"{', custom tree mask' if topk > 1 else ', causal: chains need no mask'}); overlap scheduling off")


def build_parts(config: EngineConfig, loaded=None) -> EngineParts:
    """Every start-up step in order; logs what was decided."""
    model = load_model_setup(config, loaded)
    attention = choose_attention(config, model)
    kv = size_kv_cache(config, model, attention)
    backend = build_backend(attention.selection, kv.pool, attention.hardware,
                            speculative_attention_mode=config.speculative_attention_mode)
    if config.enable_deterministic_inference:  # every step through the extend path, mixed steps' decodes too
        for side in (backend, getattr(backend, "prefill_backend", None)):
            if hasattr(side, "split_mixed"):
                side.split_mixed = False
    # the one place the step budget's device default is resolved
    budget = resolve_step_budget(config.max_num_batched_tokens, config.max_running_requests, model.device.type,
                                 piecewise=piecewise_off_reason(config, model) is None)
    graphs = build_graphs(config, model, attention, backend, kv, budget)
    lines = startup_lines(config, model, attention, kv, graphs, budget)
    for line in lines:
        log.info(line)
    return EngineParts(model=model, attention=attention, backend=backend, kv=kv, graphs=graphs, startup_lines=lines,
                       step_budget=budget)
