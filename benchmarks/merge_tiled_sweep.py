"""The tiled split merge (kernels/merge_tiled.py) alone, one request x 128 heads x 512 columns, over its column
tile and warps: which shape reads the partials fastest when one tile holds every split. Partials: float32,
bfloat16, and the column-split kernel's scaled float16 rows (512 + 8 halves in the float32 rows' bytes).

    PYTHONPATH=src python3 benchmarks/merge_tiled_sweep.py out.json [SPLITS ...]
"""

from __future__ import annotations

import json
import sys

import torch
import triton

import attnserve.attention.kernels.merge_tiled as mt
from attnserve.bench.timing import time_call

HEADS, LATENT = 128, 512


def partials(splits: int, kind: str) -> torch.Tensor:
    """`[1, H, S, 512]` partials as the decode kernels leave them (`[1, H, S, 520]` of float16 scaled rows)."""
    o = torch.randn(1, HEADS, splits, LATENT, device="cuda")  # [1, H, S, 512]
    if kind == "float16-scaled":
        rows = o.view(torch.float16)[..., : LATENT + 8]  # [1, H, S, 520], row stride 1024 halves
        rows[..., LATENT] = 0.0  # k = 0: the merge still loads it and multiplies by 2^-k
        return rows
    return o.to(getattr(torch, kind))


def main(path: str, split_counts: tuple[int, ...] = (64, 32)) -> int:
    rows = []
    for splits in split_counts:
        num_splits = torch.full((1,), splits, device="cuda", dtype=torch.int32)
        for kind in ("float32", "bfloat16", "float16-scaled"):
            partial_o = partials(splits, kind)
            partial_lse = torch.randn(1, HEADS, splits, device="cuda")  # [1, H, S]
            out = torch.empty(1, HEADS, LATENT, device="cuda", dtype=torch.bfloat16)
            for cols in (32, 64, 128, 256):
                for warps in (1, 2, 4):
                    def call(cols=cols, warps=warps, partial_o=partial_o, partial_lse=partial_lse, out=out,
                             num_splits=num_splits, splits=splits):
                        mt._merge_tiled_kernel[(1, HEADS, triton.cdiv(LATENT, cols))](
                            out, partial_o, partial_lse, num_splits, 1.0, out.stride(0), out.stride(1),
                            partial_o.stride(0), partial_o.stride(1), partial_o.stride(2), partial_lse.stride(0),
                            partial_lse.stride(1), V_DIM=LATENT, BLOCK_DV=cols, BLOCK_S=splits, ONE_TILE=True,
                            SCALED=partial_o.dtype == torch.float16, num_warps=warps)

                    us = time_call(call, use_graph=True)[0]
                    rows.append({"splits": splits, "partials": kind, "cols": cols, "warps": warps,
                                 "us": round(us, 2)})
                    print(json.dumps(rows[-1]), flush=True)
    with open(path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], tuple(int(x) for x in sys.argv[2:]) or (64, 32)))
