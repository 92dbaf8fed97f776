"""Engine decode speed on one GPU against the memory roofline: overlap scheduling on/off, backends.

A Llama-3-8B-shaped model with random weights (bf16) serves each workload
(`--workloads`, REQUESTSxINPUTxOUTPUT: that many requests of INPUT random prompt
tokens and exactly OUTPUT new tokens each). A decode step must read every weight
once plus every request's K/V once, so its lower bound is (weight bytes + KV
bytes) / copy bandwidth, with the bandwidth measured in the same run
(device-to-device copy, read + write). The report gives, per configuration:
the median wall time of full-batch decode steps (scheduling, sampling and graph
replay included; with overlap, the interval between consecutive steps' tokens)
next to that bound; the device span of a step and the GPU's idle time between
steps (CUDA events, no sync); synchronizing CUDA calls made while launching
decode steps (torch's sync debug mode, during the warm-up); and a hash of every output, so
greedy tokens with overlap on and off can be compared.

Every configuration is warmed before it is timed, with the workload's own shapes (its prompts
prefilled in the same chunks, decode at its full batch), so no Triton compile or first-use
cost lands in the timed run, whichever configuration comes first. `--max-num-batched-tokens`
takes a list: each configuration then runs once per step budget (labels `CONFIG@BUDGET`).

    PYTHONPATH=src python3 benchmarks/engine_gpu_decode.py --workloads 64x1024x256,1x1024x256 \
        --configs triton-graphs,triton-graphs-no-overlap --out out/engine_gpu_decode.json
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import time
import traceback
import warnings
from datetime import datetime, timezone

import torch


def copy_bandwidth(gib: float = 2.0) -> float:
    """Bytes/s of a device-to-device copy, counting read + write."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / statistics.median(times)


def weight_bytes(model: torch.nn.Module, batch: int) -> int:
    """Bytes a decode step of `batch` requests reads from the weights.

    Every parameter except the embedding table (only B rows are gathered). Routed MoE experts count by the
    expected share a batch touches: with top-k of E experts chosen uniformly (random weights route near
    uniformly), an expert is untouched by all B tokens with probability (1 - k/E)^B.
    """
    from attnserve.models.moe import Experts, MoE

    experts = {id(p) for m in model.modules() if isinstance(m, Experts) for p in m.parameters()}
    touched = 1.0
    for m in model.modules():
        if isinstance(m, MoE):
            e, k = m.gate.num_experts, m.gate.top_k
            touched = 1.0 - (1.0 - k / e) ** batch
            break
    total = 0.0
    embed = model.embed_tokens.weight
    for p in model.parameters():
        if p is embed and model.lm_head.weight is not embed:
            continue
        total += p.numel() * p.element_size() * (touched if id(p) in experts else 1.0)
    return int(total)


def _median_ms(values: list[float]) -> float | None:
    return round(statistics.median(values) * 1e3, 3) if values else None


def _count_syncs(engine, steps: int) -> tuple[int, list[str]]:
    """Synchronizing CUDA calls (torch's sync debug mode) while launching `steps` engine steps (the wait for
    the previous step's tokens, outside the launch, is the one sync a step is meant to have)."""
    if not torch.cuda.is_available():
        return 0, []
    launch = engine._launch

    def watched(in_flight):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return launch(in_flight)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    engine._launch = watched
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for _ in range(steps):
                if engine.has_work():
                    engine.step()
        finally:
            engine._launch = launch
    msgs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
    return len(msgs), sorted(set(msgs))[:5]


def run_config(loaded, label: str, workload: tuple[int, int, int], args, bw: float, **engine_kw) -> dict:
    """One configuration on one workload: warm it on the workload's shapes, then time the workload."""
    from attnserve.engine.config import EngineConfig
    from attnserve.engine.engine import Engine
    from attnserve.engine.sampling_params import SamplingParams

    requests, input_len, output_len = workload
    cuda = args.device == "cuda"
    vocab = loaded.config.vocab_size
    cfg = EngineConfig(
        device=args.device, dtype="bf16" if cuda else "fp32", max_running_requests=max(requests, 4),
        cuda_graph_max_bs=max(requests, 4), max_total_tokens=max(requests, 4) * (input_len + output_len) + 1024,
        chunked_prefill_size=args.chunked_prefill_size, disable_radix_cache=True, **engine_kw,
    )
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    engine = Engine(cfg, loaded=loaded)
    startup_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    # warm-up: compiles every kernel the run needs (extend, mixed, decode at a few batch sizes), then
    # counts synchronizing calls over decode steps
    for _ in range(3):
        engine.add_request(torch.randint(0, vocab, (300,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=24, ignore_eos=True))
    for _ in range(6):
        engine.step()
    syncs, sync_msgs = _count_syncs(engine, 12)
    engine.run_until_done()
    # the workload's shapes, untimed: its prefill chunks and mixed steps, decode at its full batch
    t_warm = time.perf_counter()
    for _ in range(requests):
        engine.add_request(torch.randint(0, vocab, (input_len,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=min(output_len, 8), ignore_eos=True))
    engine.run_until_done()
    sync()
    warmup_s = time.perf_counter() - t_warm
    engine.step_times = type(engine.step_times)()
    spans: list[tuple[str, int, object, object]] = []  # (mode, batch size, start event, end event) per step
    plain_launch = engine._launch

    def timed_launch(in_flight):
        if not cuda:
            return plain_launch(in_flight)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        step = plain_launch(in_flight)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        if step is not None:
            spans.append((step.batch.mode.value, step.batch.batch_size, start, end))
        return step

    engine._launch = timed_launch
    prompts = [torch.randint(0, vocab, (input_len,), generator=g).tolist() for _ in range(requests)]
    params = SamplingParams(max_new_tokens=output_len, ignore_eos=True)
    sync()
    start = time.perf_counter()
    reqs = [engine.add_request(p, params) for p in prompts]
    engine.run_until_done()
    sync()
    total_s = time.perf_counter() - start
    engine._launch = plain_launch
    st = engine.step_times
    full = [t for t, b in zip(st.decode, st.decode_batch) if b == requests]
    # device span of each full-batch decode step, and the GPU's idle time before the next step starts
    device_s, idle_s = [], []
    for (mode, bs, a, b), nxt in zip(spans, spans[1:] + [None]):
        if mode == "decode" and bs == requests:
            device_s.append(a.elapsed_time(b) / 1e3)
            if nxt is not None and nxt[0] == "decode":
                idle_s.append(max(0.0, b.elapsed_time(nxt[2]) / 1e3))
    bpt = engine.parts.kv.pool.bytes_per_token
    # full-batch decode step k (k = 1..output_len-1) reads K/V of input_len + k tokens per request
    kv_bytes = [requests * (input_len + k) * bpt for k in range(1, output_len)]
    wbytes = weight_bytes(loaded.model, requests)
    bound = statistics.mean((wbytes + kv) / bw for kv in kv_bytes)
    med = statistics.median(full) if full else float("nan")
    ttfts = sorted(r.ttft_s for r in reqs)
    digest = hashlib.sha256(json.dumps([r.output_ids for r in reqs]).encode()).hexdigest()[:16]
    out = {
        "label": label,
        "workload": f"{requests} x {input_len}/{output_len}",
        "engine_settings": dict(engine_kw),
        "max_num_batched_tokens": engine.step_budget.label,  # as resolved: N, off, auto or auto:S
        "overlap_schedule": engine.overlap,
        "prefill_backend": engine.parts.attention.prefill_backend,
        "decode_backend": engine.parts.attention.decode_backend,
        "cuda_graph_batch_sizes": engine.parts.graphs.batch_sizes,
        "startup_s": round(startup_s, 2),
        "workload_warmup_s": round(warmup_s, 3),
        "total_s": round(total_s, 3),
        "output_tok_per_s": round(requests * output_len / total_s, 1),
        "full_batch_decode_steps": len(full),
        "decode_step_ms_median": round(med * 1e3, 3),
        "decode_step_ms_p10": round(sorted(full)[len(full) // 10] * 1e3, 3) if full else None,
        "decode_step_ms_p90": round(sorted(full)[len(full) * 9 // 10] * 1e3, 3) if full else None,
        "decode_device_span_ms_median": _median_ms(device_s),
        "gpu_idle_between_decode_steps_ms_median": _median_ms(idle_s),
        "gpu_idle_between_decode_steps_ms_p90": round(sorted(idle_s)[len(idle_s) * 9 // 10] * 1e3, 3) if idle_s else None,
        "weight_bytes_read_per_step": wbytes,
        "roofline_step_ms_mean": round(bound * 1e3, 3),
        "fraction_of_roofline": round(bound / med, 3) if full else None,
        "sync_calls_launching_12_warmup_steps": syncs,
        "sync_call_messages": sync_msgs,
        "prefill_steps": len(st.extend) + len(st.mixed),
        "prefill_s": round(sum(st.extend) + sum(st.mixed), 3),
        "ttft_s_median": round(ttfts[len(ttfts) // 2], 3),
        "graphed_steps": engine.runner.steps_graphed,
        "eager_steps": engine.runner.steps_eager,
        "pages_leaked": engine.pages_leaked(),
        "outputs_sha256_16": digest,
        "first_tokens_req0": reqs[0].output_ids[:16],
    }
    print(json.dumps(out), flush=True)
    engine.close()  # leaves a tensor-parallel world, if the configuration made one
    del engine, reqs
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


CONFIGS = {
    "triton-graphs": {"attention_backend": "triton"},
    "triton-graphs-no-overlap": {"attention_backend": "triton", "disable_overlap_schedule": True},
    "triton-graphs-unfused": {"attention_backend": "triton", "disable_fused_ops": True},
    "triton-graphs-pdl": {"attention_backend": "triton", "enable_pdl": True},  # the fused ops launched with PDL
    "triton-eager": {"attention_backend": "triton", "disable_cuda_graph": True},
    # tp 1 through the tensor-parallel path: a torch.distributed world of one rank (NCCL), each step broadcast,
    # every all-reduce / all-gather run (`benchmarks/h200.sh tp` compares it with triton-graphs)
    "triton-graphs-tp1-world": {"attention_backend": "triton", "dist_init_addr": "auto"},
    "flashinfer-decode": {"prefill_attention_backend": "triton", "decode_attention_backend": "flashinfer"},
    "flashinfer": {"attention_backend": "flashinfer"},
    "torch-native": {"attention_backend": "torch_native"},
}


def parse_workload(text: str) -> tuple[int, int, int]:
    try:
        requests, input_len, output_len = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"workload {text!r}: expected REQUESTSxINPUTxOUTPUT, e.g. 64x1024x256") from None
    if min(requests, input_len, output_len) < 1:
        raise SystemExit(f"workload {text!r}: every number must be >= 1")
    return requests, input_len, output_len


def write_report(args, loaded, bw: float, results: list[dict], errors: dict) -> dict:
    """The JSON record of what ran so far (rewritten after every configuration, so a run stopped by its
    time limit keeps what it measured)."""
    cuda = args.device == "cuda"
    ratios = {}
    for workload in {r["workload"] for r in results}:
        by = {r["label"]: r for r in results if r["workload"] == workload}

        def ratio(slow: str, fast: str, key: str = "decode_step_ms_median", by=by):
            if slow in by and fast in by and by[slow][key] and by[fast][key]:
                return round(by[slow][key] / by[fast][key], 3)
            return None

        ratios[workload] = {k: v for k, v in {
            "overlap_speedup_decode_step": ratio("triton-graphs-no-overlap", "triton-graphs"),
            "overlap_speedup_total": ratio("triton-graphs-no-overlap", "triton-graphs", "total_s"),
            "overlap_outputs_identical": (by["triton-graphs"]["outputs_sha256_16"]
                                          == by["triton-graphs-no-overlap"]["outputs_sha256_16"])
            if {"triton-graphs", "triton-graphs-no-overlap"} <= set(by) else None,
            "triton_vs_flashinfer_decode_step": ratio("flashinfer-decode", "triton-graphs"),
            "fused_ops_speedup_decode_step": ratio("triton-graphs-unfused", "triton-graphs"),
            "fused_ops_speedup_total": ratio("triton-graphs-unfused", "triton-graphs", "total_s"),
            "cuda_graph_speedup_decode_step": ratio("triton-eager", "triton-graphs"),
            "pdl_speedup_decode_step": ratio("triton-graphs", "triton-graphs-pdl"),
            "pdl_outputs_identical": (by["triton-graphs"]["outputs_sha256_16"]
                                      == by["triton-graphs-pdl"]["outputs_sha256_16"])
            if {"triton-graphs", "triton-graphs-pdl"} <= set(by) else None,
        }.items() if v is not None}
    import triton

    report = {
        "what": f"{args.preset} random weights bf16, workloads {args.workloads} (requests x input/output), "
                f"radix cache off, chunked prefill {args.chunked_prefill_size}, max_num_batched_tokens "
                f"{args.max_num_batched_tokens or 'the engine default'}; every configuration warmed on its workload",
        "gpu": torch.cuda.get_device_name() if cuda else "cpu (script check only)",
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__},
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "copy_bandwidth_TBps": round(bw / 1e12, 3),
        "weight_bytes_read_per_step": weight_bytes(loaded.model, 1 << 20),  # every weight, every expert
        "results": results,
        "ratios": ratios,
        "errors": errors,
        "command": "PYTHONPATH=src python3 benchmarks/engine_gpu_decode.py "
                   f"--workloads {args.workloads} --configs {args.configs} --chunked-prefill-size "
                   f"{args.chunked_prefill_size}"
                   + (f" --max-num-batched-tokens {args.max_num_batched_tokens}" if args.max_num_batched_tokens else ""),
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3-8b")
    ap.add_argument("--workloads", default="64x1024x256",
                    help="comma-separated REQUESTSxINPUTxOUTPUT (default: 64x1024x256; the overlap check adds "
                    "1x1024x256)")
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--max-num-batched-tokens", default=None, metavar="N[,N...]",
                    help="the step budget (the engine's knob: N, <= 0 off, auto, auto:S, or default); a list runs "
                    "every configuration once per value (default: the engine's default)")
    ap.add_argument("--configs", default="triton-graphs,triton-graphs-no-overlap",
                    help=f"comma-separated, of: {', '.join(CONFIGS)}")
    ap.add_argument("--out", default="benchmarks/results/engine_gpu_overlap.json")
    ap.add_argument("--device", default="cuda", help="cpu only to check the script (no roofline meaning)")
    args = ap.parse_args()
    workloads = [parse_workload(w) for w in args.workloads.split(",")]
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")

    from attnserve.models.loader import load_model

    cuda = args.device == "cuda"
    bw = copy_bandwidth() if cuda else 10e9
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    loaded = load_model(args.preset, dtype="bf16" if cuda else "fp32", device=args.device, random_weights=True)
    # N (<= 0: off), auto, auto:S, or default (the flag unset: the device's default)
    budgets = [None] if args.max_num_batched_tokens is None else [
        None if b.strip() == "default" else b.strip() for b in args.max_num_batched_tokens.split(",")]
    results, errors = [], {}
    for workload in workloads:
        for name, budget in ((n, b) for n in args.configs.split(",") for b in budgets):
            label = name if budget is None else f"{name}@{budget}"
            if budget is None and args.max_num_batched_tokens is not None:
                label = f"{name}@default"
            try:
                settings = dict(CONFIGS[name])
                if budget is not None:
                    settings["max_num_batched_tokens"] = budget
                if settings.get("dist_init_addr") == "auto":  # a free local port for the one-rank world
                    from attnserve.distributed.launch import free_local_addr

                    settings["dist_init_addr"] = free_local_addr()
                results.append(run_config(loaded, label, workload, args, bw, **settings))
                write_report(args, loaded, bw, results, errors)
            except Exception as exc:  # noqa: BLE001 - one failing configuration must not lose the others
                errors[f"{label} {workload}"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
    report = write_report(args, loaded, bw, results, errors)
    print(json.dumps({"ratios": report["ratios"], "errors": errors}, indent=2))


if __name__ == "__main__":
    main()
