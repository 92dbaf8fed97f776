"""Where the column-split MLA decode's time goes at one long request (128 heads, page 1): its fixed cost and its
tile, where the latent comes from, and the merge after it.

Timing only, CUDA graphs (the kernel tests check results). At 64 splits (128 CTAs, one wave) the context is set to
k 64-key tiles a split, so the kernel's time is F + k t. "scattered" pages are a random permutation of the pool,
"l2-hot" pages are drawn from a 4096-token window that stays in L2. Then 1 x 32768 with the merge kernel, the
merge alone, and the same with the merge kernel's preferred shared-memory carveout set to all-shared (does the
L1/shared reconfiguration between a 225 KB kernel and one with none cost anything?), and an empty kernel on the
decode's and the merge's grids (a launch's floor in a graph).

    PYTHONPATH=src python3 benchmarks/mla_colsplit_cost.py [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys

import torch
import triton
import triton.language as tl
from mla_split_cost import HEADS, WIDTH, fixed_and_per_tile, inputs, write_json  # a sibling script

import attnserve.attention.kernels.mla_decode_gluon as gluon_host
from attnserve.attention.kernels.decode import partial_strides
from attnserve.attention.kernels.merge_tiled import _merge_tiled_kernel, merge_splits_tiled
from attnserve.bench.timing import time_call

SPLITS = 64
CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9


@triton.jit
def _empty_kernel(X):
    """A launch's floor: nothing read, one CTA writes one word."""
    if tl.program_id(0) + tl.program_id(1) + tl.program_id(2) == 0:
        tl.store(X, 1)


def colsplit_calls(seq: int, pages: str):
    """(decode, merge) of one request of `seq` keys at 128 heads, page 1, float16 partials, as the backend launches
    them; pages: mla_split_cost.inputs' "own" (scattered) or "hot" (an L2-resident window)."""
    q, kv, kv_indptr, kv_indices, seq_lens, num_splits, out, po, pl = inputs(1, HEADS, seq, 1, SPLITS, torch.float16,
                                                                              pages)

    def decode():
        gluon_host.launch_mla_decode_gluon(q, kv, out, po, pl, kv_indptr, kv_indices, seq_lens, num_splits, SPLITS, 1,
                                           WIDTH ** -0.5, False, partial_strides(po, pl), kernel="gluon_colsplit")

    def merge():
        merge_splits_tiled(out, po, pl, num_splits, SPLITS, 1.0)

    return decode, merge


def timed(fn, reps: int = 3) -> list[float]:
    fn()
    torch.cuda.synchronize()
    return [round(time_call(fn, use_graph=True)[0], 2) for _ in range(reps)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiles", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--json")
    args = p.parse_args()
    rows, fits = [], {}
    for pages, label in (("own", "scattered"), ("hot", "l2-hot")):
        points = []
        for k in args.tiles:
            us = timed(colsplit_calls(SPLITS * 64 * k, pages)[0])
            points.append((k, min(us)))
            rows.append({"case": "decode kernel", "pages": label, "tiles_per_split": k, "seq": SPLITS * 64 * k,
                         "us": us})
            print(json.dumps(rows[-1]), flush=True)
        f, t = fixed_and_per_tile(points)
        fits[label] = {"F_us": round(f, 2), "t_us": round(t, 3)}
        print(f"  {label}: F = {f:.2f} us, t = {t:.3f} us a tile", flush=True)
    decode, merge = colsplit_calls(32768, "own")

    def both():
        decode()
        merge()

    cuda = ctypes.CDLL("libcuda.so.1")
    for carveout in ("default", "all-shared"):
        if carveout == "all-shared":  # every compiled merge kernel (this process launched one shape)
            for compiled in _merge_tiled_kernel.device_caches[torch.cuda.current_device()][0].values():
                rc = cuda.cuFuncSetAttribute(ctypes.c_void_p(compiled.function),
                                             CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
                assert rc == 0, f"cuFuncSetAttribute returned {rc}"
        for name, fn in (("decode + merge", both), ("merge alone", merge), ("decode alone", decode)):
            rows.append({"case": f"1x32768 {name}", "merge_carveout": carveout, "us": timed(fn)})
            print(json.dumps(rows[-1]), flush=True)
    flag = torch.zeros(1, device="cuda", dtype=torch.int32)
    for grid, warps in (((2, 1, SPLITS), 8), ((1, HEADS, 8), 1)):  # the decode's grid, the merge's
        rows.append({"case": "empty kernel", "grid": list(grid), "warps": warps,
                     "us": timed(lambda grid=grid, warps=warps: _empty_kernel[grid](flag, num_warps=warps))})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        write_json(args.json, rows, fits=fits)
    return 0


if __name__ == "__main__":
    sys.exit(main())
