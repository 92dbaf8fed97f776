"""The split-KV merge inside the column-split MLA decode kernel, after a grid-wide barrier: for one wave of CTAs.

Why: one long request (1 x 32768 at 128 heads) runs 128 CTAs of 8 key tiles each. Merging their partials in a
second kernel costs a launch and a ramp, about 4 us of the 32 (H200, benchmarks/NOTES.md). When every CTA of
the grid is resident at once (a cooperative launch guarantees it, or fails), the CTAs can instead wait for one
another after storing their partials and then each merge a share of the (request, head) rows while the
partials are still in L2.

The barrier is a counter and a generation in global memory (`sync` `[2]` int32, zeros before the first launch):
each arrival adds one; the last resets the counter and bumps the generation, which the others poll. It leaves
the pair ready for the next launch, so a CUDA graph can replay it. One launch at a time may use a pair.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _grid_barrier(Sync, expected):
    """Wait until `expected` arrivals (this one included) reached Sync; every earlier global store of the calling
    threads is then visible to every arriver (the counter's acquire-release chain)."""
    gl.thread_barrier()  # the callers' stores are issued before the arrival (bar.sync, then a gpu-scope release)
    gen = gl.atomic_add(Sync + 1, 0, sem="relaxed", scope="gpu")  # read before arriving: the flip comes after
    arrived = gl.atomic_add(Sync, 1, sem="acq_rel", scope="gpu")
    if arrived == expected - 1:
        gl.atomic_xchg(Sync, 0, sem="relaxed", scope="gpu")
        gl.atomic_add(Sync + 1, 1, sem="release", scope="gpu")
    else:
        while gl.atomic_add(Sync + 1, 0, sem="acquire", scope="gpu") == gen:
            pass
    gl.thread_barrier()


@gluon.jit
def _merge_rows(Out, PartialO, PartialLse, num_splits, first, step, rows, stride_ob, stride_oh, stride_pb,
                stride_ph, stride_ps, stride_lb, stride_lh, col0, NUM_HEADS: gl.constexpr, COLUMNS: gl.constexpr,
                LATENT: gl.constexpr, BLOCK_S: gl.constexpr, CHUNKS: gl.constexpr, SCALED: gl.constexpr):
    """Rows first, first + step, ... of the (request, head) rows: columns col0 .. col0 + COLUMNS of each merged
    from the request's splits (BLOCK_S x CHUNKS of them at most), by their base-2 LSEs, as merge_tiled.py does.
    SCALED: float16 partials, each row's power-of-two exponent k in column LATENT (stored = partial x 2^k)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [1, 4], [1, 0])  # [BLOCK_S, COLUMNS], 16-byte loads
    offs_s = gl.arange(0, BLOCK_S, layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, COLUMNS, layout=gl.SliceLayout(0, layout))
    for r in range(first, rows, step):
        b = r // NUM_HEADS
        h = r % NUM_HEADS
        n = gl.load(num_splits + b)
        lse_row = PartialLse + b * stride_lb + h * stride_lh
        o_row = PartialO + b * stride_pb + h * stride_ph
        m = gl.max(gl.load(lse_row + offs_s, mask=offs_s < n, other=float("-inf")), axis=0)
        for c in gl.static_range(1, CHUNKS):
            s = c * BLOCK_S + offs_s
            m = gl.maximum(m, gl.max(gl.load(lse_row + s, mask=s < n, other=float("-inf")), axis=0))
        m = gl.maximum(m, -1.0e30)
        acc = gl.zeros([COLUMNS], gl.float32, layout=gl.SliceLayout(0, layout))
        total = gl.zeros([], gl.float32)
        for c in gl.static_range(CHUNKS):
            s = c * BLOCK_S + offs_s
            ok = s < n
            w = gl.exp2(gl.load(lse_row + s, mask=ok, other=float("-inf")) - m)  # [BLOCK_S]
            total += gl.sum(w, axis=0)
            if SCALED:
                w = w * gl.exp2(-gl.load(o_row + s * stride_ps + LATENT, mask=ok, other=0.0).to(gl.float32))
            o = gl.load(o_row + s[:, None] * stride_ps + cols[None, :], mask=ok[:, None], other=0.0)
            acc += gl.sum(w[:, None] * o.to(gl.float32), axis=0)
        total = gl.where(total > 0.0, total, 1.0)
        gl.store(Out + b * stride_ob + h * stride_oh + cols, (acc / total).to(Out.dtype.element_ty))
