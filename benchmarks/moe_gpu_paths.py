"""Routed-expert paths on one GPU at decode batch sizes: every expert on every token (dense) vs one grouped GEMM.

`Experts.forward` picks dense bmm's while a batch is a few dozen tokens and torch's grouped GEMM below E
(token, choice) pairs; this measures both at DeepSeek-V2-Lite's expert shapes (64 experts, hidden 2048,
1408 channels, top-6) so the switch point is a measured one. Each path is captured in a CUDA graph (as the
engine replays decode) and timed over replays; both are checked against each other first.

    PYTHONPATH=src python3 benchmarks/moe_gpu_paths.py --out benchmarks/results/moe_gpu_paths.json
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--channels", type=int, default=1408)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--batches", default="1,4,8,16,32,64,128,256")
    ap.add_argument("--out", default="benchmarks/results/moe_gpu_paths.json")
    args = ap.parse_args()

    from attnserve.bench.timing import time_graph
    from attnserve.models.moe import Experts

    torch.manual_seed(0)
    with torch.device("cuda"):
        experts = Experts(args.experts, args.hidden, args.channels, "silu").to(torch.bfloat16)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.02)
    weight_bytes = sum(p.numel() * p.element_size() for p in experts.parameters())
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        x = torch.randn(batch, args.hidden, device="cuda", dtype=torch.bfloat16)  # [B, hidden]
        scores = torch.rand(batch, args.experts, device="cuda")
        weights, ids = scores.topk(args.top_k, dim=-1)  # each [B, k]; distinct experts per token
        weights = weights / weights.sum(-1, keepdim=True)
        with torch.no_grad():
            dense = experts.forward_dense(x, weights, ids)
            grouped = experts.forward_grouped(x, weights, ids)
            err = ((grouped.float() - dense.float()).norm() / dense.float().norm()).item()
            touched = ids.unique().numel()
            row = {"batch": batch, "experts_touched": touched, "grouped_vs_dense_rel_err": round(err, 5)}
            for name in ("dense", "grouped"):
                path = getattr(experts, f"forward_{name}")
                us = time_graph(lambda path=path, x=x, weights=weights, ids=ids: path(x, weights, ids))
                row[f"{name}_us"] = round(us, 1)
                row[f"{name}_TBps_touched_weights"] = round(weight_bytes * touched / args.experts / us / 1e6, 2)
        row["grouped_speedup"] = round(row["dense_us"] / row["grouped_us"], 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
    import triton

    report = {
        "what": f"routed experts {args.experts} x (hidden {args.hidden}, channels {args.channels}), top-{args.top_k}, "
                "bf16, uniform random routing; CUDA-graph replays",
        "gpu": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__},
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "weight_bytes_all_experts": weight_bytes,
        "rows": rows,
        "command": "PYTHONPATH=src python3 benchmarks/moe_gpu_paths.py",
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
