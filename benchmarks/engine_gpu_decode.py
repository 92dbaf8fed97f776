"""Engine decode speed on one GPU against the memory roofline, and against FlashInfer decode.

A Llama-3-8B-shaped model with random weights (bf16) serves --requests requests of
--input-len random prompt tokens and exactly --output-len new tokens each. A
decode step must read every weight once plus every request's K/V once, so its
lower bound is (weight bytes + KV bytes) / copy bandwidth, with the bandwidth
measured in the same run (device-to-device copy, read + write). The report gives
the median wall time of full-batch decode steps (scheduling, sampling and graph
replay included) next to that bound, for each backend configuration.

    PYTHONPATH=src python3 benchmarks/engine_gpu_decode.py --out results.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import traceback
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


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every parameter except the embedding table (only B rows are gathered)."""
    total = 0
    embed = model.embed_tokens.weight
    for p in model.parameters():
        if p is embed and model.lm_head.weight is not embed:
            continue
        total += p.numel() * p.element_size()
    return total


def run_config(loaded, label: str, args, bw: float, wbytes: int, **engine_kw) -> dict:
    from attnserve.engine.config import EngineConfig
    from attnserve.engine.engine import Engine
    from attnserve.engine.sampling_params import SamplingParams

    vocab = loaded.config.vocab_size
    cfg = EngineConfig(
        device=args.device, dtype="bf16" if args.device == "cuda" else "fp32", max_running_requests=args.requests, cuda_graph_max_bs=args.requests,
        max_total_tokens=args.requests * (args.input_len + args.output_len) + 1024,
        chunked_prefill_size=args.chunked_prefill_size, disable_radix_cache=True, **engine_kw,
    )
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    engine = Engine(cfg, loaded=loaded)
    startup_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    # warm-up: compiles every kernel the run needs (extend, mixed, decode at a few batch sizes)
    for _ in range(3):
        engine.add_request(torch.randint(0, vocab, (300,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.run_until_done()
    engine.step_times = type(engine.step_times)()
    forward_s: list[float] = []  # model forward (graph replay or eager) of full-batch decode steps
    plain_forward = engine.runner.forward

    def timed_forward(batch):
        sync()
        t = time.perf_counter()
        out = plain_forward(batch)
        sync()
        if batch.mode.value == "decode" and batch.batch_size == args.requests:
            forward_s.append(time.perf_counter() - t)
        return out

    engine.runner.forward = timed_forward
    prompts = [torch.randint(0, vocab, (args.input_len,), generator=g).tolist() for _ in range(args.requests)]
    params = SamplingParams(max_new_tokens=args.output_len, ignore_eos=True)
    sync()
    start = time.perf_counter()
    reqs = [engine.add_request(p, params) for p in prompts]
    engine.run_until_done()
    sync()
    total_s = time.perf_counter() - start
    st = engine.step_times
    full = [t for t, b in zip(st.decode, st.decode_batch) if b == args.requests]
    bpt = engine.parts.kv.pool.bytes_per_token
    # full-batch decode step k (k = 1..output_len-1) reads K/V of input_len + k tokens per request
    kv_bytes = [args.requests * (args.input_len + k) * bpt for k in range(1, args.output_len)]
    bound_s = [(wbytes + kv) / bw for kv in kv_bytes]
    med = statistics.median(full) if full else float("nan")
    bound = statistics.mean(bound_s)
    ttfts = sorted(r.ttft_s for r in reqs)
    out = {
        "label": label,
        "engine_settings": {k: v for k, v in engine_kw.items()},
        "prefill_backend": engine.parts.attention.prefill_backend,
        "decode_backend": engine.parts.attention.decode_backend,
        "cuda_graph_batch_sizes": engine.parts.graphs.batch_sizes,
        "startup_s": round(startup_s, 2),
        "total_s": round(total_s, 3),
        "output_tok_per_s": round(args.requests * args.output_len / total_s, 1),
        "full_batch_decode_steps": len(full),
        "decode_step_ms_median": round(med * 1e3, 3),
        "decode_step_ms_p10": round(sorted(full)[len(full) // 10] * 1e3, 3) if full else None,
        "decode_step_ms_p90": round(sorted(full)[len(full) * 9 // 10] * 1e3, 3) if full else None,
        "decode_forward_ms_median": round(statistics.median(forward_s) * 1e3, 3) if forward_s else None,
        "roofline_step_ms_mean": round(bound * 1e3, 3),
        "fraction_of_roofline": round(bound / med, 3) if full else None,
        "prefill_steps": len(st.extend) + len(st.mixed),
        "prefill_s": round(sum(st.extend) + sum(st.mixed), 3),
        "ttft_s_median": round(ttfts[len(ttfts) // 2], 3),
        "graphed_steps": engine.runner.steps_graphed,
        "eager_steps": engine.runner.steps_eager,
        "pages_leaked": engine.pages_leaked(),
        "first_tokens_req0": reqs[0].output_ids[:16],
    }
    print(json.dumps(out), flush=True)
    engine.close()  # leaves a tensor-parallel world, if the configuration made one
    del engine, reqs
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3-8b")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--configs", default="triton-graphs,triton-graphs-unfused,triton-eager,flashinfer-decode")
    ap.add_argument("--out", default="benchmarks/results/engine_gpu_decode.json")
    ap.add_argument("--device", default="cuda", help="cpu only to check the script (no roofline meaning)")
    args = ap.parse_args()

    from attnserve.distributed.launch import free_local_addr
    from attnserve.models.loader import load_model

    bw = copy_bandwidth() if args.device == "cuda" else 10e9
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    dtype = "bf16" if args.device == "cuda" else "fp32"
    loaded = load_model(args.preset, dtype=dtype, device=args.device, random_weights=True)
    wbytes = weight_bytes(loaded.model)
    configs = {
        "triton-graphs": {"attention_backend": "triton"},
        "triton-graphs-unfused": {"attention_backend": "triton", "disable_fused_ops": True},
        "triton-eager": {"attention_backend": "triton", "disable_cuda_graph": True},
        # tp 1 through the tensor-parallel path: a torch.distributed world of one rank (NCCL), each step
        # broadcast, every all-reduce / all-gather run (benchmarks/tp_gpu.sh compares it with triton-graphs)
        "triton-graphs-tp1-world": {"attention_backend": "triton", "dist_init_addr": free_local_addr()},
        "flashinfer-decode": {"prefill_attention_backend": "triton", "decode_attention_backend": "flashinfer"},
        "flashinfer": {"attention_backend": "flashinfer"},
        "torch-native": {"attention_backend": "torch_native"},
    }
    results, errors = [], {}
    for name in args.configs.split(","):
        try:
            results.append(run_config(loaded, name, args, bw, wbytes, **configs[name]))
        except Exception as exc:  # noqa: BLE001 - one failing configuration must not lose the others
            errors[name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            gc.collect()
            torch.cuda.empty_cache()
    by = {r["label"]: r for r in results}
    ratios = {}
    if "triton-graphs" in by and "flashinfer-decode" in by:
        ratios["triton_vs_flashinfer_decode_step"] = round(
            by["flashinfer-decode"]["decode_step_ms_median"] / by["triton-graphs"]["decode_step_ms_median"], 3)
    if "triton-graphs" in by and "triton-graphs-unfused" in by:
        ratios["fused_ops_speedup_decode_step"] = round(
            by["triton-graphs-unfused"]["decode_step_ms_median"] / by["triton-graphs"]["decode_step_ms_median"], 3)
        ratios["fused_ops_speedup_output_tok_per_s"] = round(
            by["triton-graphs"]["output_tok_per_s"] / by["triton-graphs-unfused"]["output_tok_per_s"], 3)
        ratios["fused_ops_same_first_tokens"] = (
            by["triton-graphs"]["first_tokens_req0"] == by["triton-graphs-unfused"]["first_tokens_req0"])
    if "triton-graphs" in by and "triton-eager" in by:
        ratios["cuda_graph_speedup_decode_step"] = round(
            by["triton-eager"]["decode_step_ms_median"] / by["triton-graphs"]["decode_step_ms_median"], 3)
    import triton

    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (script check only)"
    report = {
        "what": f"{args.preset} random weights bf16, {args.requests} requests x {args.input_len} in / "
                f"{args.output_len} out, radix cache off, chunked prefill {args.chunked_prefill_size}",
        "gpu": gpu,
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__},
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "copy_bandwidth_TBps": round(bw / 1e12, 3),
        "weight_bytes_read_per_step": wbytes,
        "results": results,
        "ratios": ratios,
        "errors": errors,
        "command": "PYTHONPATH=src python3 benchmarks/engine_gpu_decode.py",
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps({"ratios": ratios, "errors": errors}, indent=2))


if __name__ == "__main__":
    main()
