"""The one-launch expert alignment (attnserve.ops.kernels.moe_align) at decode batch sizes: its loop steps
and warps swept, one program or one per expert, against the torch alignment, at DeepSeek-V2-Lite's routing (64 routed experts, top-6, and 2
shared experts every token takes, as the engine aligns them).

Per batch: every launch setting is checked bit for bit against ops.moe_align.align_by_expert, then timed as
CUDA-graph replays (as the engine replays decode; several routings cycled). The best setting per batch is
what ops/kernels/moe_align.py's LAUNCHES should hold.

    PYTHONPATH=src python3 benchmarks/moe_align_gpu.py --out moe_align_h100.json              # on the GPU (~1 min)
    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/moe_align_gpu.py --tiny --out r.json  # the CPU check
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import time

import torch

from attnserve.bench.timing import time_cpu, time_graph
from attnserve.ops.kernels.fused_moe import moe_tiles
from attnserve.ops.kernels.moe_align import AlignLaunch, align_in_one_launch, launch_for
from attnserve.ops.moe_align import align_by_expert
from attnserve.versions import package_versions

ROUTINGS = 4  # routings cycled through per timing


def launches(tiny: bool) -> list[AlignLaunch]:
    if tiny:
        return [AlignLaunch(), AlignLaunch(chunk=32, fill_chunk=64, num_warps=2), AlignLaunch(per_expert=True)]
    swept = [AlignLaunch(c, 1024, w) for c, w in itertools.product((32, 64, 128), (1, 2, 4, 8))]
    per_expert = [AlignLaunch(c, 1024, w, per_expert=True) for c, w in itertools.product((32, 64, 128), (1, 2, 4))]
    return [AlignLaunch(64, 64, 4)] + swept + per_expert  # first: the launch before the padding fill widened


def _same(a, b) -> bool:
    return torch.equal(a.sorted_pairs, b.sorted_pairs) and torch.equal(a.block_expert, b.block_expert)


def _time_us(fns, device: str) -> float:
    """Median microseconds per call, cycling through the routings' calls."""
    def run():
        for fn in fns:
            fn()
    if device == "cpu":
        return time_cpu(run) / len(fns)
    return time_graph(run, calls_per_graph=5) / len(fns)


def batch_row(tokens: int, args, device: str) -> dict:
    gen = torch.Generator().manual_seed(tokens)
    ids_sets = [torch.rand(tokens, args.experts, generator=gen).topk(args.top_k, dim=-1).indices.to(device)
                for _ in range(ROUTINGS)]  # each [T, top_k]: distinct experts per token
    block_m = moe_tiles(torch.device(device), tokens, args.experts, args.hidden, args.channels, args.top_k).block_m
    pairs = tokens * (args.top_k + args.shared)
    row = {"tokens": tokens, "pairs": pairs, "block_m": block_m, "shipped_launch": vars(launch_for(pairs)),
           "launches": []}
    oracles = [align_by_expert(ids, args.experts, block_m, args.shared) for ids in ids_sets]
    row["torch_us"] = round(_time_us([lambda ids=ids: align_by_expert(ids, args.experts, block_m, args.shared)
                                      for ids in ids_sets], device), 2)
    for launch in dict.fromkeys([launch_for(pairs), *launches(args.tiny)]):  # the shipped one first
        fns = [lambda ids=ids, launch=launch: align_in_one_launch(ids, args.experts, block_m, args.shared, launch)
               for ids in ids_sets]
        if not all(_same(fn(), oracle) for fn, oracle in zip(fns, oracles)):
            raise SystemExit(f"alignment differs from the torch oracle at {tokens} tokens with {launch}")
        row["launches"].append({**vars(launch), "us": round(_time_us(fns, device), 2)})
    best = min(row["launches"], key=lambda r: r["us"])
    shipped = next(r for r in row["launches"] if {k: r[k] for k in row["shipped_launch"]} == row["shipped_launch"])
    row["best"], row["shipped_us"] = best, shipped["us"]
    print(f"{tokens:>5} tokens {pairs:>5} pairs  torch {row['torch_us']:8.2f} us  shipped {shipped['us']:8.2f} us"
          f"  best {best['us']:8.2f} us (chunk {best['chunk']}, fill {best['fill_chunk']}, warps {best['num_warps']}"
          f"{', a program per expert' if best['per_expert'] else ''})",
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,16,64,128")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--shared", type=int, default=2)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--channels", type=int, default=1408)
    ap.add_argument("--tiny", action="store_true", help="two launches, two batches: the CPU check of the script")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batches = [1, 8] if args.tiny else [int(b) for b in args.batches.split(",")]
    t0 = time.time()
    rows = [batch_row(tokens, args, device) for tokens in batches]
    report = {
        "what": f"one-program expert alignment, {args.experts} routed + {args.shared} shared experts, top-{args.top_k};"
                " CUDA-graph replays, microseconds per call; checked bit for bit against the torch alignment",
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreted: timings meaningless)",
        "versions": package_versions(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "rows": rows, "seconds": round(time.time() - t0, 1),
        "command": "PYTHONPATH=src python3 benchmarks/moe_align_gpu.py --out OUT",
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
