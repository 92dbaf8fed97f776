"""The column-split MLA decode's float32 and float16 (row-scaled) partials, timed against each other in one run.

One long request at 128 heads (page 1) cut into `--splits` splits, the decode kernel and the merge kernel,
CUDA graphs as the race; each variant's output is also compared with the float32 one (max |diff|). Until
67d53d0 this also timed a merge inside the decode kernel after a grid barrier (slower: benchmarks/NOTES.md).

    PYTHONPATH=src python3 benchmarks/mla_merge_variants.py [--seq 32768] [--splits 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
from mla_split_cost import write_json  # a sibling script: this folder is on sys.path when one of them runs

from attnserve.attention.kernels.decode import allocate_partials
from attnserve.attention.kernels.mla_decode import mla_decode_attention
from attnserve.attention.kernels.mla_decode_tiles import MLADecodeConfig
from attnserve.bench.timing import time_call

HEADS, WIDTH, LATENT = 128, 576, 512
BASE = MLADecodeConfig(64, 64, 8, 2, kernel="gluon_colsplit")
VARIANTS = {
    "float32 + merge kernel": BASE,
    "float16 + merge kernel": dataclasses.replace(BASE, partials="float16"),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[32768])
    p.add_argument("--requests", type=int, default=1)
    p.add_argument("--splits", type=int, default=64)
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    for seq in args.seq:
        r = args.requests
        q = torch.randn(r, HEADS, WIDTH, device="cuda", dtype=torch.bfloat16)  # [R, H, 512 + 64]
        kv = torch.randn(r * seq, 1, WIDTH, device="cuda", dtype=torch.bfloat16)  # the latent pool, page 1
        kv_indices = torch.randperm(r * seq, device="cuda", dtype=torch.int32)  # scattered rows
        kv_indptr = torch.arange(0, r + 1, device="cuda", dtype=torch.int32) * seq
        seq_lens = torch.full((r,), seq, device="cuda", dtype=torch.int32)
        num_splits = torch.full((r,), args.splits, device="cuda", dtype=torch.int32)
        partials = allocate_partials(r, HEADS, args.splits, LATENT, q.device)
        baseline = None
        for name, config in VARIANTS.items():
            out = torch.empty(r, HEADS, LATENT, device="cuda", dtype=torch.bfloat16)

            def call(out=out, config=config):
                mla_decode_attention(q, kv, out, kv_indptr, kv_indices, seq_lens, num_splits, args.splits, 1,
                                     WIDTH ** -0.5, LATENT, partials=partials, write_final=False, config=config)

            call()
            torch.cuda.synchronize()
            result = out.float().clone()
            baseline = result if baseline is None else baseline
            us, method = time_call(call, use_graph=True)
            call()  # after the graph's replays: the same result
            torch.cuda.synchronize()
            rows.append({"seq": seq, "requests": r, "splits": args.splits, "variant": name, "us": round(us, 2),
                         "method": method, "max_abs_diff_vs_float32": float((result - baseline).abs().max()),
                         "replay_equal": bool(torch.equal(out.float(), result))})
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
