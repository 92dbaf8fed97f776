"""Where the Gluon MLA decode kernel's time goes: the full kernel against itself with one part left out, and the
warp-specialised ping-pong kernel at two register budgets.

Timing only (the ablated kernels compute wrong results): the PV wgmma, the score wgmma, the latent copies
inside the loop or the softmax are left out (`_mla_decode_gluon_kernel`'s ABLATE), on issue 12's two 128-head decode shapes.

    PYTHONPATH=src python3 benchmarks/gluon_mla_ablate.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from attnserve.attention.kernels.mla_decode_gluon import launch_mla_decode_gluon
from attnserve.bench.timing import time_call

PARTS = {0: "full", 1: "no PV", 2: "no score", 3: "no copies in loop", 4: "no softmax"}


def inputs(batch: int, seq: int, page_size: int, heads: int = 128):
    pages = batch * seq // page_size
    q = torch.randn(batch, heads, 576, device="cuda", dtype=torch.bfloat16)  # [B, H, 512 + 64]
    kv = torch.randn(pages * page_size, 1, 576, device="cuda", dtype=torch.bfloat16)  # the latent pool
    kv_indices = torch.randperm(pages, device="cuda", dtype=torch.int32)  # scattered pages
    kv_indptr = torch.arange(0, pages + 1, seq // page_size, device="cuda", dtype=torch.int32)  # [B + 1]
    seq_lens = torch.full((batch,), seq, device="cuda", dtype=torch.int32)
    return q, kv, kv_indptr, kv_indices, seq_lens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", default=None)
    p.add_argument("--pingpong-only", action="store_true", help="time only the warp-specialised kernel")
    args = p.parse_args()
    rows = []
    for batch, seq, page in ((128, 4096, 1), (64, 8192, 64)):
        q, kv, kv_indptr, kv_indices, seq_lens = inputs(batch, seq, page)
        out = torch.empty(batch, 128, 512, device="cuda", dtype=torch.bfloat16)
        ones = torch.ones(batch, device="cuda", dtype=torch.int32)
        variants = [] if args.pingpong_only else [(part, {"ablate": a}) for a, part in PARTS.items()]
        variants += [(f"pingpong, {r} registers", {"pingpong": True, "consumer_regs": r}) for r in (232, 240)]
        for part, options in variants:
            def call(options=options):
                launch_mla_decode_gluon(q, kv, out, out, out, kv_indptr, kv_indices, seq_lens, ones, 1, page,
                                        576 ** -0.5, True, (0, 0, 0, 0, 0), **options)

            us, _ = time_call(call, use_graph=True)
            tiles = batch * 2 * seq // 64  # (request, head group) x 64-key tiles
            rows.append({"shape": f"{batch}x{seq} p{page}", "part": part, "us": round(us, 1),
                         "ns_per_tile_per_sm": round(us * 1e3 * 132 / tiles, 1)})
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
