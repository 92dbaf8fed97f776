"""What a split costs the Gluon seesaw MLA decode kernel apart from its tiles: one long request at 128 heads (and,
with --requests, many).

Timing only, CUDA graphs, no oracle (the kernel tests check results). At a fixed split count (so a fixed number
of CTAs, one wave) the context is set to `k` 64-key tiles per split for several k: the kernel's time is then
F + k t, F a CTA's cost apart from its tiles (launch, the query and first tiles' latency, the epilogue) and t a
tile. The same is timed with the partial stores left out (a runtime-false mask: the math still runs), with
bfloat16 partials, over 64-token pages, and the merge alone; `--variants` picks them. Where the latent bytes come
from: "l2-hot" draws every page from a 4 MB window (the tiles then read L2, not HBM); "h64-pairs-shared" and
"h64-own-pages" run twice the requests at 64 heads (the same CTAs and tiles), two requests reading the same pages as
a 128-head request's head groups do, or each its own (twice the HBM bytes). `--requests 128 --splits 1 --tiles 64`
is the many-request decode 128 x 4096.

    PYTHONPATH=src python3 benchmarks/mla_split_cost.py [--splits 64 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import pathlib
import sys
import tempfile

import torch

import attnserve.attention.kernels.mla_decode_gluon as gluon_host
from attnserve.attention.kernels.decode import partial_strides
from attnserve.attention.kernels.merge_tiled import merge_splits_tiled
from attnserve.bench.timing import time_call

HEADS, WIDTH, LATENT = 128, 576, 512
HOT_TOKENS = 4096  # 4.7 MB of latent: the "hot" pages' window
SEESAW = pathlib.Path(gluon_host.__file__).with_name("mla_decode_seesaw.py")
PARTIAL_STORE = "o.to(PartialO.dtype.element_ty), mask=mask)"


def patched_seesaw(name: str, old: str, new: str):
    """The seesaw kernel with one source line changed (what a variant leaves out), loaded as its own module."""
    src = SEESAW.read_text()
    assert src.count(old) == 1, f"{old!r} moved: update this harness"
    path = pathlib.Path(tempfile.mkdtemp()) / f"seesaw_{name}.py"
    path.write_text(src.replace(old, new))
    spec = importlib.util.spec_from_file_location(f"seesaw_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._mla_decode_seesaw_kernel


def seesaw_without_partial_stores():
    """The partial-output store masked by a runtime-false condition (the split stride is negative), so the
    compiler keeps the math that feeds it."""
    return patched_seesaw("no_partial_store", PARTIAL_STORE,
                          "o.to(PartialO.dtype.element_ty), mask=mask & (stride_ps < 0))")


def inputs(requests: int, heads: int, seq: int, page: int, splits: int, partial_dtype: torch.dtype, pages_of: str):
    """pages_of: "own" (each request its scattered pages), "pair" (requests 2i and 2i + 1 read the same pages, as a
    128-head request's two head groups do), "hot" (every request's pages drawn from a 4 MB window that stays in L2)."""
    per_request = seq // page
    pool_pages = per_request * (requests if pages_of == "own" else max(requests // 2, 1))
    hot_pages = max(HOT_TOKENS // page, 1)
    if pages_of == "hot":
        pool_pages = max(pool_pages, hot_pages)
    q = torch.randn(requests, heads, WIDTH, device="cuda", dtype=torch.bfloat16)  # [R, H, 512 + 64]
    kv = torch.randn(pool_pages * page, 1, WIDTH, device="cuda", dtype=torch.bfloat16)  # the latent pool
    kv_indices = torch.randperm(pool_pages, device="cuda", dtype=torch.int32)  # scattered pages
    if pages_of == "pair":
        kv_indices = kv_indices.view(-1, 1, per_request).expand(-1, 2, -1).reshape(-1)[: requests * per_request]
    elif pages_of == "hot":
        kv_indices = torch.randint(0, hot_pages, (requests * per_request,), device="cuda", dtype=torch.int32)
    kv_indices = kv_indices.contiguous()
    kv_indptr = torch.arange(0, requests + 1, device="cuda", dtype=torch.int32) * per_request
    seq_lens = torch.full((requests,), seq, device="cuda", dtype=torch.int32)
    num_splits = torch.full((requests,), splits, device="cuda", dtype=torch.int32)
    out = torch.empty(requests, heads, LATENT, device="cuda", dtype=torch.bfloat16)
    scaled = partial_dtype == torch.float16  # the column-split kernel's scaled rows, laid out as mla_decode.py does
    partial_o = torch.empty(requests, heads, splits, LATENT, device="cuda",
                            dtype=torch.float32 if scaled else partial_dtype)  # [R, H, S, 512]
    if scaled:  # [R, H, S, 512 + 8] halves in the float32 rows' bytes
        partial_o = partial_o.view(torch.float16)[..., : LATENT + 8]
    partial_lse = torch.empty(requests, heads, splits, device="cuda", dtype=torch.float32)
    return q, kv, kv_indptr, kv_indices, seq_lens, num_splits, out, partial_o, partial_lse


def time_variant(kernel, requests: int, heads: int, seq: int, page: int, splits: int, partial_dtype: torch.dtype,
                 merge: bool, pages_of: str) -> float:
    q, kv, kv_indptr, kv_indices, seq_lens, num_splits, out, po, pl = inputs(requests, heads, seq, page, splits,
                                                                              partial_dtype, pages_of)
    strides = partial_strides(po, pl)

    def call():
        if kernel is not None:
            gluon_host.launch_mla_decode_gluon(q, kv, out, po, pl, kv_indptr, kv_indices, seq_lens, num_splits,
                                               splits, page, WIDTH ** -0.5, False, strides)
        if merge:
            merge_splits_tiled(out, po, pl, num_splits, splits, 1.0)

    original = gluon_host._mla_decode_seesaw_kernel
    gluon_host._mla_decode_seesaw_kernel = kernel or original
    try:
        return time_call(call, use_graph=True)[0]
    finally:
        gluon_host._mla_decode_seesaw_kernel = original


def fixed_and_per_tile(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(F, t) of the least-squares line us = F + k t through (k tiles a split, us) points."""
    n = len(points)
    sk, su = sum(k for k, _ in points), sum(u for _, u in points)
    skk, sku = sum(k * k for k, _ in points), sum(k * u for k, u in points)
    t = (n * sku - sk * su) / (n * skk - sk * sk)
    return (su - t * sk) / n, t


def write_json(path: str, rows: list[dict], **extra) -> None:
    """A probe's rows with the GPU, the versions and the date (also for mla_merge_variants.py, mla_colsplit_cost.py)."""
    import triton

    with open(path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), **extra, "rows": rows},
                  f, indent=1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--splits", type=int, nargs="+", default=[64, 32])
    p.add_argument("--requests", type=int, default=1, help="128-head requests (the 64-head variants take twice)")
    p.add_argument("--tiles", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="64-key tiles per split")
    p.add_argument("--variants", nargs="+", default=["full", "no-partial-store", "bf16-partials", "page64", "merge",
                                                     "merge-bf16"])
    p.add_argument("--json")
    args = p.parse_args()
    kernels = {"full": gluon_host._mla_decode_seesaw_kernel}
    if "no-partial-store" in args.variants:
        kernels["no-partial-store"] = seesaw_without_partial_stores()
    full = kernels["full"]
    plans = {  # variant: (kernel, page, partial dtype, merge, heads a request, pages_of)
        "full": (full, 1, torch.float32, False, HEADS, "own"),
        "no-partial-store": (kernels.get("no-partial-store"), 1, torch.float32, False, HEADS, "own"),
        "bf16-partials": (full, 1, torch.bfloat16, False, HEADS, "own"),
        "page64": (full, 64, torch.float32, False, HEADS, "own"),
        "merge": (None, 1, torch.float32, True, HEADS, "own"),
        "merge-bf16": (None, 1, torch.bfloat16, True, HEADS, "own"),
        "full+merge": (full, 1, torch.float32, True, HEADS, "own"),
        "bf16+merge": (full, 1, torch.bfloat16, True, HEADS, "own"),
        # where the latent bytes come from: the same CTAs and tiles, twice the requests at 64 heads
        "l2-hot": (full, 1, torch.float32, False, HEADS, "hot"),
        "h64-pairs-shared": (full, 1, torch.float32, False, 64, "pair"),
        "h64-own-pages": (full, 1, torch.float32, False, 64, "own"),
    }
    rows = []
    for splits in args.splits:
        for variant in args.variants:
            kernel, page, dtype, merge, heads, pages_of = plans[variant]
            requests = args.requests * HEADS // heads
            for k in args.tiles:
                us = time_variant(kernel, requests, heads, splits * 64 * k, page, splits, dtype, merge, pages_of)
                rows.append({"requests": requests, "heads": heads, "splits": splits, "tiles_per_split": k,
                             "seq": splits * 64 * k, "variant": variant, "pages": pages_of, "us": round(us, 2)})
                print(json.dumps(rows[-1]), flush=True)
            fit = [(r["tiles_per_split"], r["us"]) for r in rows if r["splits"] == splits and r["variant"] == variant]
            if len({k for k, _ in fit}) > 1:
                f, t = fixed_and_per_tile(fit)
                print(f"  {variant} at {splits} splits: F = {f:.2f} us, t = {t:.3f} us a tile", flush=True)
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
