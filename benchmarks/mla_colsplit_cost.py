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
import datetime
import json
import sys

import torch
import triton
import triton.language as tl

from attnserve.attention.kernels import merge_tiled
from attnserve.attention.kernels.decode import allocate_partials, partial_strides
from attnserve.attention.kernels.mla_decode_colsplit import _mla_decode_colsplit_kernel
from attnserve.attention.kernels.mla_decode_gluon import COLSPLIT_REGS
from attnserve.bench.timing import time_call

HEADS, WIDTH, LATENT, SPLITS, HOT_TOKENS = 128, 576, 512, 64, 4096
CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9


@triton.jit
def _empty_kernel(X):
    """A launch's floor: nothing read, one CTA writes one word."""
    if tl.program_id(0) + tl.program_id(1) + tl.program_id(2) == 0:
        tl.store(X, 1)


class Case:
    """One request of `seq` keys, its pool pages scattered or from the L2-hot window, float16 partials."""

    def __init__(self, seq: int, pages: str):
        self.q = torch.randn(1, HEADS, WIDTH, device="cuda", dtype=torch.bfloat16)  # [1, H, 512 + 64]
        self.kv = torch.randn(max(seq, HOT_TOKENS), 1, WIDTH, device="cuda", dtype=torch.bfloat16)  # the pool
        rows = torch.randperm(seq, device="cuda") if pages == "scattered" else \
            torch.randint(0, HOT_TOKENS, (seq,), device="cuda")
        self.kv_indices = rows.to(torch.int32)  # [seq]
        self.kv_indptr = torch.tensor([0, seq], device="cuda", dtype=torch.int32)
        self.seq_lens = torch.tensor([seq], device="cuda", dtype=torch.int32)
        self.num_splits = torch.tensor([SPLITS], device="cuda", dtype=torch.int32)
        po, self.pl = allocate_partials(1, HEADS, SPLITS, LATENT, self.q.device)
        self.po = po.view(torch.float16)[..., : LATENT + 8]  # [1, H, S, 512 + 8] scaled rows
        self.out = torch.empty(1, HEADS, LATENT, device="cuda", dtype=torch.bfloat16)

    def decode(self):
        return _mla_decode_colsplit_kernel[(2, 1, SPLITS)](
            self.q, self.kv, self.out, self.po, self.pl, self.kv_indptr, self.kv_indices, self.seq_lens,
            self.num_splits, self.seq_lens, self.seq_lens, WIDTH ** -0.5 * 1.4426950408889634,
            self.q.stride(0), self.q.stride(1), self.kv.stride(0), self.out.stride(0), self.out.stride(1),
            *partial_strides(self.po, self.pl), NUM_HEADS=HEADS, LATENT=LATENT, ROPE=64, PAGE_SIZE=1,
            WRITE_FINAL=False, TOKENS=1, num_warps=4, CONSUMER_REGS=COLSPLIT_REGS, SCALED=True)

    def merge(self):
        po, pl, out = self.po, self.pl, self.out
        return merge_tiled._merge_tiled_kernel[(1, HEADS, LATENT // merge_tiled.MERGE_COLUMNS)](
            out, po, pl, self.num_splits, 1.0, out.stride(0), out.stride(1), po.stride(0), po.stride(1),
            po.stride(2), pl.stride(0), pl.stride(1), V_DIM=LATENT, BLOCK_DV=merge_tiled.MERGE_COLUMNS,
            BLOCK_S=SPLITS, ONE_TILE=True, SCALED=True, num_warps=1)

    def both(self):
        self.decode()
        self.merge()


def timed(fn, reps: int = 3) -> list[float]:
    fn()
    torch.cuda.synchronize()
    return [round(time_call(fn, use_graph=True)[0], 2) for _ in range(reps)]


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares us = F + k t over (k, us)."""
    n = len(points)
    sk, su = sum(k for k, _ in points), sum(u for _, u in points)
    skk, sku = sum(k * k for k, _ in points), sum(k * u for k, u in points)
    t = (n * sku - sk * su) / (n * skk - sk * sk)
    return (su - t * sk) / n, t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiles", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--json")
    args = p.parse_args()
    rows, fits = [], {}
    for pages in ("scattered", "l2-hot"):
        points = []
        for k in args.tiles:
            us = timed(Case(SPLITS * 64 * k, pages).decode)
            points.append((k, min(us)))
            rows.append({"case": "decode kernel", "pages": pages, "tiles_per_split": k, "seq": SPLITS * 64 * k,
                         "us": us})
            print(json.dumps(rows[-1]), flush=True)
        f, t = fit(points)
        fits[pages] = {"F_us": round(f, 2), "t_us": round(t, 3)}
        print(f"  {pages}: F = {f:.2f} us, t = {t:.3f} us a tile", flush=True)
    case = Case(32768, "scattered")
    cuda = ctypes.CDLL("libcuda.so.1")
    for carveout in ("default", "all-shared"):
        if carveout == "all-shared":
            handle = case.merge().function
            rc = cuda.cuFuncSetAttribute(ctypes.c_void_p(handle), CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                         100)
            assert rc == 0, f"cuFuncSetAttribute returned {rc}"
        for name, fn in (("decode + merge", case.both), ("merge alone", case.merge), ("decode alone", case.decode)):
            rows.append({"case": f"1x32768 {name}", "merge_carveout": carveout, "us": timed(fn)})
            print(json.dumps(rows[-1]), flush=True)
    flag = torch.zeros(1, device="cuda", dtype=torch.int32)
    for grid, warps in (((2, 1, SPLITS), 8), ((1, HEADS, LATENT // merge_tiled.MERGE_COLUMNS), 1)):
        rows.append({"case": "empty kernel", "grid": list(grid), "warps": warps,
                     "us": timed(lambda grid=grid, warps=warps: _empty_kernel[grid](flag, num_warps=warps))})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "fits": fits,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
