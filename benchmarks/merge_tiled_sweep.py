"""The tiled split merge (kernels/merge_tiled.py) alone, one request x 128 heads x 512 columns, over its column
tile and warps: which shape reads the partials fastest when one tile holds every split.

    PYTHONPATH=src python3 benchmarks/merge_tiled_sweep.py out.json
"""

from __future__ import annotations

import json
import sys

import torch
import triton

import attnserve.attention.kernels.merge_tiled as mt
from attnserve.bench.timing import time_call

HEADS, LATENT = 128, 512


def main(path: str) -> int:
    rows = []
    for splits in (64, 32):
        num_splits = torch.full((1,), splits, device="cuda", dtype=torch.int32)
        for dtype in (torch.float32, torch.bfloat16):
            partial_o = torch.randn(1, HEADS, splits, LATENT, device="cuda").to(dtype)  # [1, H, S, 512]
            partial_lse = torch.randn(1, HEADS, splits, device="cuda")  # [1, H, S]
            out = torch.empty(1, HEADS, LATENT, device="cuda", dtype=torch.bfloat16)
            for cols in (16, 32, 64, 128, 256):
                for warps in (1, 2, 4, 8):
                    def call(cols=cols, warps=warps):
                        mt._merge_tiled_kernel[(1, HEADS, triton.cdiv(LATENT, cols))](
                            out, partial_o, partial_lse, num_splits, 1.0, out.stride(0), out.stride(1),
                            partial_o.stride(0), partial_o.stride(1), partial_o.stride(2), partial_lse.stride(0),
                            partial_lse.stride(1), V_DIM=LATENT, BLOCK_DV=cols, BLOCK_S=splits, ONE_TILE=True,
                            num_warps=warps)

                    us = time_call(call, use_graph=True)[0]
                    rows.append({"splits": splits, "dtype": str(dtype), "cols": cols, "warps": warps,
                                 "us": round(us, 2)})
                    print(json.dumps(rows[-1]), flush=True)
    with open(path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
