"""Which warp-specialised TMA attention kernels run on this GPU, and where the others stop.

Each variant runs in its own process under a time limit; a variant that has not finished by then
prints where its Python thread waits (faulthandler): inside triton.compile (a slow compile) or in
torch.cuda.synchronize (a kernel that never finishes). Variants:
  minimal      fixed-length causal attention, Q/K/V through host descriptors, one key loop, warp-specialised
  minimal-dev  the same with descriptors the kernel builds (tl.make_tensor_descriptor)
  minimal-nows the host-descriptor kernel without warp specialisation
  ours         kernels/prefill_tma.py, 128 x 128 tiles, warp-specialised, device descriptors
  ours-persist the same, persistent (the work loop specialised)
  ours-host    the same as ours with host descriptors

Warp specialisation splits the 128-row query tile between two consumer warpgroups and loads each 64-row
half with one TMA box; a host descriptor's box stays 128 rows (the compiled kernel's tensordesc_meta), so the
halves overrun their buffers and the mbarrier byte counts; a device descriptor is built with the 64-row box.

    PYTHONPATH=src python3 benchmarks/diagnose_prefill_ws.py [--timeout 15] [--out diag.json] [VARIANT ...]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import subprocess
import sys
import time

VARIANTS = ("ours", "minimal", "minimal-dev", "minimal-nows", "ours-persist", "ours-host")


def _minimal_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def attn(desc_q, desc_k, desc_v, Q, Out, qk_scale, n_ctx, total, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             D: tl.constexpr, WS: tl.constexpr, Q_BY_POINTER: tl.constexpr, DEVICE_DESC: tl.constexpr):
        if DEVICE_DESC:  # desc_* are the tensors; the compiler builds (and sizes) the descriptors
            desc_q = tl.make_tensor_descriptor(desc_q, [total, D], [D, 1], [BLOCK_M, D])
            desc_k = tl.make_tensor_descriptor(desc_k, [total, D], [D, 1], [BLOCK_N, D])
            desc_v = tl.make_tensor_descriptor(desc_v, [total, D], [D, 1], [BLOCK_N, D])
        start = tl.program_id(0) * BLOCK_M
        row0 = tl.program_id(1) * n_ctx
        rows = start + tl.arange(0, BLOCK_M)
        if Q_BY_POINTER:
            q = tl.load(Q + (row0 + rows)[:, None] * D + tl.arange(0, D)[None, :])
        else:
            q = desc_q.load([row0 + start, 0])
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        for n0 in tl.range(0, start + BLOCK_M, BLOCK_N, warp_specialize=WS):
            k = desc_k.load([row0 + n0, 0])
            s = tl.dot(q, k.T)
            cols = n0 + tl.arange(0, BLOCK_N)
            s = tl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s * qk_scale - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = desc_v.load([row0 + n0, 0])
            acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(Out + (row0 + rows)[:, None] * D + tl.arange(0, D)[None, :], o.to(tl.bfloat16))

    return attn


def run_variant(name: str) -> dict:
    import torch
    import torch.nn.functional as F
    from triton.tools.tensor_descriptor import TensorDescriptor

    torch.manual_seed(0)
    b, h, n, d = 2, 8, 512, 128
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    t0 = time.perf_counter()
    if name.startswith("minimal"):
        attn = _minimal_kernel()
        flat = [x.reshape(b * h * n, d) for x in (q, k, v)]
        out = torch.empty_like(flat[0])
        device = name == "minimal-dev"
        if device:
            import triton

            triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
            descs = flat
        else:
            descs = [TensorDescriptor(x, [b * h * n, d], [d, 1], [128, d]) for x in flat]
        attn[(n // 128, b * h)](*descs, flat[0], out, d**-0.5 * 1.4426950408889634, n, b * h * n, BLOCK_M=128,
                                BLOCK_N=128, D=d, WS=name != "minimal-nows", Q_BY_POINTER=name == "minimal-qptr",
                                DEVICE_DESC=device, num_warps=4 if name != "minimal-nows" else 8, num_stages=2)
        out = out.view(b, h, n, d)
    else:
        from attnserve.attention.kernels.extend import build_extend_tiles
        from attnserve.attention.kernels.prefill_tma import PrefillTmaConfig, prefill_tma_attention

        cfg = PrefillTmaConfig(128, 128, 4, 2, True, persistent=1 if name == "ours-persist" else 0,
                               device_descriptors=name != "ours-host")
        rows = [x.transpose(1, 2).reshape(b * n, h, d).contiguous() for x in (q, k, v)]  # [T, H, D]
        out = torch.empty_like(rows[0])
        indptr = torch.arange(0, b * n + 1, n, device="cuda", dtype=torch.int32)  # [B+1]
        tiles = build_extend_tiles([0] * b, [n] * b, 128, "cuda")
        prefill_tma_attention(rows[0], rows[1], rows[2], indptr[:-1], out, tiles, indptr,
                              torch.full((b,), n, device="cuda", dtype=torch.int32), d**-0.5, config=cfg)
        out = out.view(b, n, h, d).transpose(1, 2)
    launched = time.perf_counter() - t0
    torch.cuda.synchronize()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    return {"variant": name, "first_call_s": round(launched, 2), "done_s": round(time.perf_counter() - t0, 2),
            "rel_err_vs_sdpa": err}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--timeout", type=float, default=15.0)
    p.add_argument("--out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        faulthandler.dump_traceback_later(args.timeout - 2, exit=True)
        print(json.dumps(run_variant(args.variants[0])), flush=True)
        return 0
    results = []
    for name in args.variants:
        start = time.perf_counter()
        try:
            res = subprocess.run([sys.executable, __file__, "--child", "--timeout", str(args.timeout), name],
                                 capture_output=True, text=True, timeout=args.timeout + 5)
            lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(lines[-1]) if lines else {"variant": name, "rc": res.returncode}
            if not lines:  # timed out inside: the faulthandler dump names the frame it waited in
                stack = [ln.strip() for ln in res.stderr.splitlines() if ln.strip().startswith("File")]
                row["stuck_in"] = stack[:6]
                row["stderr_tail"] = res.stderr.strip().splitlines()[-3:]
        except subprocess.TimeoutExpired:
            row = {"variant": name, "error": "no answer (killed)"}
        row["wall_s"] = round(time.perf_counter() - start, 1)
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
