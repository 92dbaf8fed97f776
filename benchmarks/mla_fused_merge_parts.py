"""Where the column-split kernel's in-kernel merge spends its time: the same launch with parts left out.

1 x 32768 at 128 heads, page 1, 64 splits, float16 partials, CUDA graphs. Each part runs in its own process
(Gluon compiles a kernel with the helpers it finds then, so a no-op replaces a helper before the first launch):

- fused: the grid barrier and the merge (as shipped with fused_merge)
- barrier-only: the merge replaced by nothing (the cooperative launch and the barrier kept)
- merge-only: the barrier replaced by nothing (the merge reads whatever is there: timing only)
- neither: both replaced (the cooperative launch and the partition handshake alone)
- kernel-only: the plain launch, no merge anywhere (the merge kernel's share is plain - kernel-only)
- plain: the plain launch and the merge kernel

    PYTHONPATH=src python3 benchmarks/mla_fused_merge_parts.py [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys

PARTS = ("fused", "barrier-only", "merge-only", "neither", "kernel-only", "plain")


def time_part(part: str, seq: int, splits: int) -> dict:
    import torch
    from triton.experimental import gluon

    import attnserve.attention.kernels.mla_decode_colsplit as colsplit
    from attnserve.attention.kernels.decode import allocate_partials, partial_strides
    from attnserve.attention.kernels.merge_tiled import merge_splits_tiled
    from attnserve.attention.kernels.mla_decode_gluon import launch_mla_decode_gluon
    from attnserve.bench.timing import time_call

    @gluon.jit
    def no_barrier(Sync, expected):
        pass

    @gluon.jit
    def no_merge(Out, PartialO, PartialLse, num_splits, first, step, rows, stride_ob, stride_oh, stride_pb,
                 stride_ph, stride_ps, stride_lb, stride_lh, col0, NUM_HEADS, COLUMNS, LATENT, BLOCK_S, CHUNKS,
                 SCALED):
        pass

    if part in ("merge-only", "neither"):
        colsplit._grid_barrier = no_barrier
    if part in ("barrier-only", "neither"):
        colsplit._merge_rows = no_merge
    heads, width, latent = 128, 576, 512
    q = torch.randn(1, heads, width, device="cuda", dtype=torch.bfloat16)  # [1, H, 576]
    kv = torch.randn(seq, 1, width, device="cuda", dtype=torch.bfloat16)  # the latent pool, page 1
    kv_indices = torch.randperm(seq, device="cuda", dtype=torch.int32)
    kv_indptr = torch.tensor([0, seq], device="cuda", dtype=torch.int32)
    seq_lens = torch.tensor([seq], device="cuda", dtype=torch.int32)
    num_splits = torch.tensor([splits], device="cuda", dtype=torch.int32)
    out = torch.empty(1, heads, latent, device="cuda", dtype=torch.bfloat16)
    po, pl = allocate_partials(1, heads, splits, latent, q.device)
    po = po.view(torch.float16)[..., : latent + 8]  # the scaled float16 rows
    fused = part not in ("kernel-only", "plain")

    def call():
        launch_mla_decode_gluon(q, kv, out, po, pl, kv_indptr, kv_indices, seq_lens, num_splits, splits, 1,
                                width ** -0.5, False, partial_strides(po, pl), kernel="gluon_colsplit",
                                fused_merge=fused)
        if part == "plain":
            merge_splits_tiled(out, po, pl, num_splits, splits, 1.0)

    us, method = time_call(call, use_graph=True)
    return {"part": part, "seq": seq, "splits": splits, "us": round(us, 2), "method": method}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=PARTS, help="time one part in this process")
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--splits", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    if args.part:
        print(json.dumps(time_part(args.part, args.seq, args.splits)), flush=True)
        return 0
    rows = []
    for _ in range(args.repeats):
        for part in PARTS:
            proc = subprocess.run([sys.executable, __file__, "--part", part, "--seq", str(args.seq), "--splits",
                                   str(args.splits)], capture_output=True, text=True)
            line = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 else json.dumps(
                {"part": part, "error": proc.stderr[-500:]})
            rows.append(json.loads(line))
            print(line, flush=True)
    if args.json:
        import torch
        import triton

        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
