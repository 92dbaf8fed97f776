"""Where a full-batch decode step's GPU time goes: kernel time by kind, from torch.profiler.

Same workload as engine_gpu_decode.py (Llama-3-8B shape, random bf16 weights,
--requests x --input-len prompts), decode run eagerly so every kernel is visible;
kernel times are what a CUDA-graph replay runs too (launch gaps excluded).

    PYTHONPATH=src python3 benchmarks/engine_gpu_profile.py --out profile.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

KINDS = (  # first match wins: GEMM names first (cuBLAS split-K kernels contain "split")
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "matmul")),
    ("kv_store", ("store",)),
    ("attention", ("decode", "extend", "attn", "split", "merge")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3-8b")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="engine_gpu_profile.json")
    args = ap.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from attnserve.engine.config import EngineConfig
    from attnserve.engine.engine import Engine
    from attnserve.engine.sampling_params import SamplingParams
    from attnserve.models.loader import load_model

    loaded = load_model(args.preset, dtype="bf16", device="cuda", random_weights=True)
    engine = Engine(EngineConfig(device="cuda", attention_backend="triton", disable_cuda_graph=True,
                                 max_running_requests=args.requests, disable_radix_cache=True,
                                 max_total_tokens=args.requests * (args.input_len + 64) + 1024,
                                 chunked_prefill_size=8192), loaded=loaded)
    g = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    for _ in range(args.requests):
        engine.add_request(torch.randint(0, vocab, (args.input_len,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=48, ignore_eos=True))
    while not engine.step_times.decode:  # prefill everything, then one decode step (warm)
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=25), flush=True)
    for ev in prof.key_averages():  # CUDA activity only: every entry is a kernel, copy or memset
        t = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
        if t:
            by_name[ev.key] += t
    for name, t in by_name.items():
        by_kind[kind_of(name)] += t
    per_step = {k: round(v / args.steps / 1e3, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:20]
    report = {
        "what": f"{args.preset} random bf16, {args.requests} x {args.input_len}, eager triton decode, per-step GPU ms",
        "gpu": torch.cuda.get_device_name(),
        "per_step_ms_by_kind": per_step,
        "per_step_ms_total": round(sum(by_kind.values()) / args.steps / 1e3, 3),
        "top_kernels_ms_per_step": [(n[:120], round(t / args.steps / 1e3, 3)) for n, t in top],
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
