"""`attnserve tune`: race the backends that run here on one model's own attention shape.

The bench race (`bench kernels`) uses fixed GQA 32/8 shapes to compare kernels across
machines; tune answers the serving question instead: for this model (heads per rank, head
width, KV dtype, page size) on this machine, at the decode batch x context grid and prefill
lengths the engine runs, which backend is fastest per side. An MLA model is raced on its own
latent (kv_lora_rank + rope, its query heads per rank) in the absorbed form the pool holds. Each contestant is the backend
the engine would instantiate (through the attention contract), checked against the float32
oracle before it is timed: one that disagrees is disqualified, not timed. The result goes to
the user's cache (choice/tuned.py), where selection finds it.
"""

from __future__ import annotations

import datetime
import os
import warnings
from dataclasses import dataclass

import torch

from attnserve.attention.layer import AttentionLayer
from attnserve.bench.oracle import oracle_output, rates, rel_err
from attnserve.bench.racers import attnserve_racer, build_race_batch, output_rows
from attnserve.bench.timing import ceilings as measure_ceilings
from attnserve.bench.timing import time_call
from attnserve.bench.workloads import MLAShape, Workload
from attnserve.choice.ranking import rank
from attnserve.choice.registry import REGISTRY, resolve_name
from attnserve.choice.selection import ServingFeatures, problems, runnable_backends
from attnserve.choice.tuned import RESULT_KIND, SCHEMA, shape_key
from attnserve.hardware import Hardware, cpu_model_name
from attnserve.kvcache.dtypes import KV_DTYPES
from attnserve.shape import AttentionShape
from attnserve.versions import package_versions

# relative-norm error against the float32 oracle above which a contestant is disqualified
TOLERANCE = {"fp32": 1e-3, "fp16": 2e-2, "bf16": 2e-2}
RACED_KV_DTYPES = tuple(TOLERANCE)


@dataclass(frozen=True)
class Grid:
    """Decode batch x context, and prefill steps (fresh chunks and a chunk over a cached prefix)."""

    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefills: tuple[tuple[int, int], ...]  # (batch, tokens) of fresh prompts
    extends: tuple[tuple[int, int, int], ...]  # (batch, prefix, new tokens): chunked prefill past the first chunk


# GPU: the engine's defaults (up to 64 running requests, 2048-token prefill chunks); the CPU gets shapes it
# can time in seconds
GRIDS = {
    ("cuda", False): Grid((1, 16, 64), (1024, 4096), ((1, 2048), (8, 512)), ((1, 4096, 2048),)),
    ("cuda", True): Grid((1, 64), (2048,), ((1, 2048),), ()),
    ("cpu", False): Grid((1, 8), (256, 1024), ((1, 512),), ((1, 512, 256),)),
    ("cpu", True): Grid((1, 4), (256,), ((1, 128),), ()),
}


def mla_shape_of(model: AttentionShape) -> MLAShape | None:
    """An MLA model's race shape: its query heads per rank over its latent (kv_lora_rank + rope).

    The softmax scale (MLAShape.qk_head_dim) stays the race's default: it changes no kernel's speed,
    and the oracle check uses the same one."""
    if not model.is_mla:
        return None
    return MLAShape(model.num_q_heads, kv_lora_rank=model.kv_lora_rank, rope_dim=model.qk_rope_head_dim)


def mla_extends(g: Grid) -> tuple[tuple[int, int, int], ...]:
    """MLA's prefill side: chunks over a cached prefix, which every MLA backend runs absorbed over the latent.

    Fresh prompts are not raced: triton runs them expanded per head (another computation, through
    forward_expanded_prefill), the others absorbed, so one time would not compare like with like. A grid
    without extends gets each prefill as a second chunk of its length over a first one."""
    return g.extends or tuple((b, t, t) for b, t in g.prefills)


def workloads_for(device: str, quick: bool, page_size: int, max_context: int | None = None,
                  mla: MLAShape | None = None) -> list[Workload]:
    """The grid as race workloads, contexts capped at the model's longest (`max_context`); MLA
    workloads (named `mla ...`, as in `bench kernels`) over the model's latent when `mla` is given."""
    g = GRIDS[("cuda" if device == "cuda" else "cpu", quick)]
    cap = max_context or max(g.decode_contexts)
    contexts = sorted({min(c, cap) for c in g.decode_contexts})
    if mla is not None:
        heads = f"h{mla.num_heads} p{page_size}"
        out = [Workload(f"mla decode {b}x{c} {heads}", "decode", b, c - 1, 1, page_size, mla)
               for c in contexts for b in g.decode_batches]
        fitting = [(b, p, n) for b, p, n in mla_extends(g) if p + n <= cap]
        if not fitting:  # a model whose context is shorter than every chunk: one chunk in two halves
            fitting = [(1, cap - cap // 2, cap // 2)]
        return out + [Workload(f"mla extend {b}x({p}+{n}) {heads}", "extend", b, p, n, page_size, mla)
                      for b, p, n in fitting]
    out = [Workload(f"decode {b}x{c} p{page_size}", "decode", b, c - 1, 1, page_size)
           for c in contexts for b in g.decode_batches]
    out += [Workload(f"prefill {b}x{min(t, cap)}", "prefill", b, 0, min(t, cap), page_size) for b, t in g.prefills]
    out += [Workload(f"extend {b}x({p}+{n})", "extend", b, p, n, page_size) for b, p, n in g.extends if p + n <= cap]
    return out


def side_of(w: Workload) -> str:
    return "decode" if w.kind == "decode" else "prefill"


def check_raceable(model: AttentionShape, kv_cache_dtype: str) -> None:
    """Refuse shapes the race batch can't build, naming what is raced."""
    if not model.is_mla and model.v_head_dim != model.head_dim:
        raise ValueError(f"tune races K and V of one width; this model's V is {model.v_head_dim} wide, "
                         f"K {model.head_dim}")
    if kv_cache_dtype not in RACED_KV_DTYPES:
        raise ValueError(f"tune races KV caches of {', '.join(RACED_KV_DTYPES)}; got {kv_cache_dtype!r}")


def contestants(hw: Hardware, model: AttentionShape, serving: ServingFeatures, page_size: int,
                wanted: list[str] | None, notes: list[str]) -> dict[str, list[str]]:
    """side -> backends to race there. Without `wanted`: every backend that passes selection's checks
    for that side. Triton on the CPU runs only through its interpreter, far too slow to time: left out
    unless asked for under TRITON_INTERPRET=1."""
    interpreting = hw.device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    wanted = [resolve_name(raw) for raw in wanted] if wanted else wanted  # each name checked once, here
    out: dict[str, list[str]] = {}
    for side in ("prefill", "decode"):
        out[side] = runnable_backends(hw, model, serving, side, page_size)
    if hw.device == "cpu" and not (wanted and "triton" in wanted):
        notes.append("triton not raced: on the CPU it runs only under TRITON_INTERPRET=1, far too slow to "
                     "time (ask with --backends triton under TRITON_INTERPRET=1 anyway)")
    if not wanted:
        return out
    chosen: dict[str, list[str]] = {side: [] for side in out}
    for name in wanted:
        if not REGISTRY[name].implemented:
            raise ValueError(f"{name!r} is not implemented in attnserve; raceable here: "
                             f"{', '.join(sorted(set(out['prefill']) | set(out['decode'])))}")
        if name == "triton" and interpreting:
            for names in chosen.values():
                names.append(name)
            continue
        sides = [side for side in out if name in out[side]]
        if not sides:
            why = problems(name, hw, model, serving, None, page_size)
            if name == "triton" and hw.device == "cpu":
                why.append("on the CPU it runs only under TRITON_INTERPRET=1")
            raise ValueError(f"{name!r} cannot run here: {'; '.join(why)}. Raceable here: "
                             f"{', '.join(sorted(set(out['prefill']) | set(out['decode']))) or 'none'}")
        for side in sides:
            chosen[side].append(name)
    return chosen


def _layer_for(model: AttentionShape, device: str):
    """The model's attention layer: its heads, width and the features a kernel must apply."""
    layer = AttentionLayer(0, model.num_q_heads, model.num_kv_heads, model.head_dim,
                           sliding_window=model.sliding_window, logit_cap=model.logit_softcap,
                           use_sinks=model.has_sinks).to(device)
    if layer.sinks is not None:
        layer.sinks.normal_()  # [Hq]
    return layer


def race_one(w: Workload, names: list[str], model: AttentionShape, dtype: torch.dtype, device: str,
             ceilings: dict, tolerance: float, seed: int, progress=None) -> list[dict]:
    """Each backend on one workload: run, check against the oracle, then time (in that order)."""
    rb = build_race_batch(w, model.num_q_heads, model.num_kv_heads, model.head_dim, dtype=dtype, device=device,
                          seed=seed)
    if w.mla is None:  # an MLA batch's layer is already the model's: its heads over the latent
        rb.layer = _layer_for(model, device)
    ref = oracle_output(rb)
    records = []
    for name in names:
        rec = {"workload": w.name, "side": side_of(w), "backend": name}
        try:
            fn = attnserve_racer(name, rb)
            with warnings.catch_warnings():  # FlexAttention's eager CPU path warns on every first call
                warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
                out = output_rows(fn(), rb)  # also compiles / JIT-builds outside the timing
            if ref is None:
                rec["checked_against"] = "nothing (the oracle's scores would not fit)"
            else:
                rec["rel_err"] = float(f"{rel_err(out, ref):.3g}")
                rec["checked_against"] = "oracle"
            if ref is not None and not rec["rel_err"] <= tolerance:
                rec["failed_check"] = f"relative error {rec['rel_err']:.2e} > {tolerance:g}: not timed"
            else:
                us, method = time_call(fn, use_graph=w.kind == "decode", device=device)
                rec.update(us=round(us, 2), timing=method, **rates(w, us, rb, ceilings))
        except Exception as exc:  # noqa: BLE001 - a backend that can't run this shape is reported, not fatal
            rec["skipped"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        rb.keep.clear()
        records.append(rec)
        if progress is not None:
            progress(rec)
    return records


def winners(records: list[dict]) -> dict[str, dict]:
    """Per side, the backend with the best mean time relative to each workload's fastest, among those
    that ran and passed every workload of the side; and its margin over the runner-up."""
    out = {}
    for side in ("prefill", "decode"):
        ranked = rank(records, side, complete_only=True)
        if not ranked:
            continue
        best = ranked[0]
        entry = {"backend": best.backend, "score": round(best.score, 4), "runner_up": None, "ratio": None}
        if len(ranked) > 1:
            entry.update(runner_up=ranked[1].backend, ratio=round(ranked[1].score / best.score, 3))
        out[side] = entry
    return out


def machine_detail(hw: Hardware) -> str:
    """A human-readable name for the report: the GPU, or the CPU model where /proc/cpuinfo names it."""
    if hw.device != "cpu":
        return hw.name
    return cpu_model_name() or hw.name


def run_tune(hw: Hardware, model: AttentionShape, serving: ServingFeatures, *, model_name: str, tp_size: int,
             quick: bool, wanted: list[str] | None, max_context: int | None = None, progress_factory=None,
             log=print, checkpoint=None) -> dict:
    """Race, check and time; the result dict `attnserve tune` writes (choice/tuned.py reads it).

    `checkpoint(records)` is called after each workload, so a run cut short still leaves what it measured."""
    device = "cuda" if hw.device == "cuda" else "cpu"
    page_size = serving.page_size or 1
    check_raceable(model, serving.kv_cache_dtype)
    notes: list[str] = []
    field = contestants(hw, model, serving, page_size, wanted, notes)
    mla = mla_shape_of(model)
    if mla is not None:
        notes.append("MLA prefill raced as chunks over a cached prefix (absorbed, as every MLA backend runs them); "
                     "fresh prompts not raced: triton runs them expanded per head, the others absorbed")
    for note in notes:
        log(note)
    workloads = workloads_for(device, quick, page_size, max_context, mla)
    dtype = KV_DTYPES[serving.kv_cache_dtype]
    ceilings = measure_ceilings(device, dtype)
    total = sum(len(field[side_of(w)]) for w in workloads)
    bar = progress_factory(total) if progress_factory else None
    records: list[dict] = []
    for i, w in enumerate(workloads):
        def step(rec, bar=bar):
            if bar is not None:
                bar.set_postfix_str(f"{rec['workload']}: {rec['backend']}")
                bar.update(1)
        records += race_one(w, field[side_of(w)], model, dtype, device, ceilings, TOLERANCE[serving.kv_cache_dtype],
                            seed=i, progress=step)
        if checkpoint is not None:
            checkpoint(records)
    if bar is not None:
        bar.close()
    return {
        "kind": RESULT_KIND,
        "schema": SCHEMA,
        "machine": hw.name,
        "device": hw.device,
        "machine_detail": machine_detail(hw),
        "versions": package_versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": model_name,
        "tp_size": tp_size,
        "shape": shape_key(model, serving.kv_cache_dtype, page_size),
        "grid": "quick" if quick else "full",
        "ceilings": ceilings,
        "notes": notes,
        "records": records,
        "winners": winners(records),
    }


__all__ = ["GRIDS", "TOLERANCE", "Grid", "check_raceable", "contestants", "mla_extends", "mla_shape_of", "race_one",
           "run_tune", "winners", "workloads_for"]
