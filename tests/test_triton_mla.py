"""Triton MLA kernels against the float64 oracle: decode over the latent pool (splits, pages, FP8), extend.

Shapes are DeepSeek's scaled down (latent 32 + rope 16 instead of 512 + 64) so the interpreter runs them
in seconds; with CUDA the same tests run compiled.
"""

import dataclasses

import pytest
import torch
from attention_helpers import rel_err

from attnserve.attention.kernels.mla.attention import mla_decode_attention
from attnserve.attention.kernels.mla.decode_table import MLADecodeConfig
from attnserve.attention.kernels.params import DecodeRows, ExtendRows
from attnserve.attention.kernels.resolve import plan_for_call
from attnserve.attention.kernels.split_plan import SplitPolicy, plan_kv_splits
from attnserve.attention.metadata import metadata_for_batch
from attnserve.reference.attention import reference_for_batch
from attnserve.reference.synthetic import make_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LATENT, ROPE = 32, 16
SMALL = MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)


def poison_unused_latent(sb) -> None:
    """NaN every latent row no request owns, so a read outside a request's KV shows in the output."""
    fb, buf = sb.fb, sb.pool.kv_buffer[0]
    used = torch.zeros(sb.pool.num_slots, dtype=torch.bool, device=buf.device)
    for row, seq in zip(fb.req_pool_indices.tolist(), fb.seq_lens_cpu):
        used[fb.req_to_token[row, :seq].long()] = True
    if sb.pool.is_fp8:
        buf.view(torch.uint8)[~used] = 0x7F  # NaN in e4m3
    else:
        buf[~used] = float("nan")


def mla_batch(prefix, ext, page_size=1, heads=20, kv_dtype=None, seed=0):
    sb = make_batch(prefix, ext, num_heads=heads, mla=(LATENT, ROPE), page_size=page_size, dtype=torch.bfloat16,
                    kv_dtype=kv_dtype, device=DEVICE, score_scale=8.0, seed=seed)
    poison_unused_latent(sb)
    return sb


def run_decode(sb, splits, write_final, config=SMALL):
    fb, lay = sb.fb, sb.layer
    meta = metadata_for_batch(fb)
    out = torch.full((fb.batch_size, lay.num_heads, LATENT), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    num_splits = torch.tensor(splits, dtype=torch.int32, device=DEVICE)  # [B]
    plan = plan_for_call(sb.q, sb.pool.kv_buffer[0], LATENT, sb.pool.page_size, config)
    rows = DecodeRows(meta.kv_indptr, meta.kv_indices, fb.seq_lens, num_splits, max(splits), sb.pool.page_size)
    return mla_decode_attention(sb.q, sb.pool.kv_buffer[0], out, rows, plan, lay.scaling, kv_scale=sb.pool.k_scale[0],
                                write_final=write_final)


@pytest.mark.parametrize("page_size,defer_pv", [(1, False), (64, False), (1, True), (16, True)])
def test_mla_decode_matches_oracle_with_splits_forced_on_and_off(page_size, defer_pv):
    """Ragged lengths, 20 heads (two head groups, the second partly masked); 1 split, several, and empty ones.
    defer_pv: each tile's values one iteration late, the last tile's after the loop (pages of 16 hold whole tiles)."""
    sb = mla_batch([70, 2, 140, 33], [1, 1, 1, 1], page_size=page_size, seed=page_size)
    ref = reference_for_batch(sb.q, sb.layer, sb.fb)
    config = MLADecodeConfig(16, 16, 4, 1, defer_pv=defer_pv)
    for splits, final in (([1, 1, 1, 1], True), ([1, 1, 1, 1], False), ([3, 2, 5, 1], False), ([9, 9, 9, 9], False)):
        out = run_decode(sb, splits, final, config)
        assert not out.isnan().any(), (splits, final)
        assert rel_err(out, ref) < 1e-2, (splits, final)


def test_mla_decode_split_plan_splits_one_long_request():
    sb = mla_batch([300], [1], heads=16)
    splits = plan_kv_splits(sb.fb.seq_lens_cpu, 1, SplitPolicy(num_sms=4, min_split_tokens=32))
    assert splits[0] > 1
    assert rel_err(run_decode(sb, splits, False), reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-2


def test_mla_decode_fp8_latent_within_its_error_bound():
    """e4m3 keeps 3 mantissa bits: each latent value is off by at most 2^-4 relative, so the output by a few %."""
    sb = mla_batch([50, 90, 7], [1, 1, 1], page_size=64, kv_dtype="fp8_e4m3")
    assert sb.pool.k_scale[0] != 1.0  # a per-tensor scale is in play
    ref = reference_for_batch(sb.q, sb.layer, sb.fb)  # the oracle reads the same quantised latent
    for splits in ([1, 1, 1], [2, 3, 1]):
        out = run_decode(sb, splits, max(splits) == 1)
        assert rel_err(out, ref) < 1e-2
    exact = make_batch([50, 90, 7], [1, 1, 1], num_heads=20, mla=(LATENT, ROPE), page_size=64, dtype=torch.bfloat16,
                       device=DEVICE, score_scale=8.0, seed=0)
    # against the unquantised latent: e4m3 rounds each value by <= 2^-4 relative; peaked scores (q x 8) about
    # double that in the output, so 10% bounds it (a wrong scale or a dropped dequantisation is off by ~100%)
    assert rel_err(out, reference_for_batch(exact.q, exact.layer, exact.fb)) < 0.1


def test_mla_decode_rejects_bad_shapes():
    sb = mla_batch([5], [1])
    with pytest.raises(ValueError, match="kv_lora_rank must be a power of two"):
        mla_decode_attention(sb.q, sb.pool.kv_buffer[0], torch.empty(1, 20, 24), DecodeRows(*([None] * 4), 1, 1),
                             plan_for_call(sb.q, sb.pool.kv_buffer[0], 24, 1, SMALL), 1.0)
    with pytest.raises(ValueError, match="out"):
        run_decode_out = torch.empty(1, 20, 16, dtype=torch.bfloat16, device=DEVICE)
        meta = metadata_for_batch(sb.fb)
        rows = DecodeRows(meta.kv_indptr, meta.kv_indices, sb.fb.seq_lens, torch.ones(1, dtype=torch.int32), 1, 1)
        mla_decode_attention(sb.q, sb.pool.kv_buffer[0], run_decode_out, rows,
                             plan_for_call(sb.q, sb.pool.kv_buffer[0], LATENT, 1, SMALL), 1.0)


# ---- extend -----------------------------------------------------------------------------------------
def run_extend(sb, custom=False, defer_pv=False):
    from attnserve.attention.kernels.extend_tiles import build_extend_tiles
    from attnserve.attention.kernels.mla.extend import INTERPRETER_MLA_EXTEND_TILES, mla_extend_attention

    fb, lay = sb.fb, sb.layer
    cfg = dataclasses.replace(INTERPRETER_MLA_EXTEND_TILES, defer_pv=defer_pv)
    meta = metadata_for_batch(fb)
    tiles = build_extend_tiles(fb.prefix_lens_cpu, fb.extend_lens_cpu, cfg.block_m, DEVICE)
    out = torch.full((fb.num_tokens, lay.num_heads, LATENT), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    mask = mask_indptr = None
    if custom:
        sizes = [e * s for e, s in zip(fb.extend_lens_cpu, fb.seq_lens_cpu)]
        mask = fb.custom_mask
        mask_indptr = torch.tensor([0, *sizes[:-1]], dtype=torch.int64).cumsum(0).to(DEVICE)
    rows = ExtendRows(tiles, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, fb.seq_lens, sb.pool.page_size, mask,
                      mask_indptr)
    return mla_extend_attention(sb.q, sb.pool.kv_buffer[0], out, rows, lay.scaling, LATENT,
                                kv_scale=sb.pool.k_scale[0], config=cfg)


@pytest.mark.parametrize("page_size,kv_dtype,defer_pv", [(1, None, False), (64, None, False),
                                                        (64, "fp8_e4m3", False), (1, None, True)])
def test_mla_extend_absorbed_over_cached_prefixes(page_size, kv_dtype, defer_pv):
    """Fresh prompts, chunked prefill over a prefix, a one-token tail: one ragged batch (defer_pv: each tile's
    values one tile late, across the unmasked and the diagonal loops)."""
    sb = mla_batch([0, 45, 70, 3], [21, 17, 1, 30], page_size=page_size, heads=3, kv_dtype=kv_dtype, seed=3)
    out = run_extend(sb, defer_pv=defer_pv)
    assert not out.isnan().any()
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-2


@pytest.mark.parametrize("defer_pv", [False, True])
def test_mla_extend_with_a_custom_mask(defer_pv):
    from attnserve.batch import ForwardMode

    sb = make_batch([12, 5], [4, 3], num_heads=2, mla=(LATENT, ROPE), dtype=torch.bfloat16, device=DEVICE,
                    custom_mask=True, mode=ForwardMode.TARGET_VERIFY, score_scale=8.0)
    out = run_extend(sb, custom=True, defer_pv=defer_pv)
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-2


def test_mla_expanded_prefill_with_v_narrower_than_k():
    """Per-head k 48 wide (nope 32 + rope 16), v 32 wide, fresh ragged prompts: the oracle per request."""
    from attnserve.attention.kernels.mha.extend import expanded_prefill_attention, plan_expanded_prefill
    from attnserve.reference.attention import attend, visibility_mask

    g = torch.Generator().manual_seed(5)
    lens, heads = [19, 1, 33], 3
    t = sum(lens)
    q = (torch.randn(t, heads, 48, generator=g) * 3).to(torch.bfloat16).to(DEVICE)  # [T, H, 48]
    k = torch.randn(t, heads, 48, generator=g).to(torch.bfloat16).to(DEVICE)  # [T, H, 48]
    v = torch.randn(t, heads, 32, generator=g).to(torch.bfloat16).to(DEVICE)  # [T, H, 32]
    plan = plan_expanded_prefill(lens, 48, DEVICE)
    out = expanded_prefill_attention(q, k, v, plan, 48**-0.5)
    assert out.shape == (t, heads, 32)
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        mask = visibility_mask(torch.arange(n, device=DEVICE), n)
        ref = attend(q[sl].double(), k[sl].double(), v[sl].double(), mask, 48**-0.5)
        assert rel_err(out[sl], ref) < 1e-2
        start += n
    with pytest.raises(ValueError, match="expanded MLA"):
        expanded_prefill_attention(q, k, torch.zeros(t, heads, 64), plan, 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_mla_expanded_prefill_at_deepseek_widths():
    """qk 192 (128 nope + 64 rope) and v 128, 16 heads, ragged fresh prompts, against the float32 oracle."""
    from attnserve.attention.kernels.mha.extend import expanded_prefill_attention, plan_expanded_prefill
    from attnserve.reference.attention import attend, visibility_mask

    g = torch.Generator(device="cuda").manual_seed(9)
    lens, heads = [1024, 7, 300], 16
    t = sum(lens)
    q = torch.randn(t, heads, 192, generator=g, device="cuda").to(torch.bfloat16)  # [T, H, 192]
    k = torch.randn(t, heads, 192, generator=g, device="cuda").to(torch.bfloat16)  # [T, H, 192]
    v = torch.randn(t, heads, 128, generator=g, device="cuda").to(torch.bfloat16)  # [T, H, 128]
    out = expanded_prefill_attention(q, k, v, plan_expanded_prefill(lens, 192, "cuda"), 192**-0.5)
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        ref = attend(q[sl].float(), k[sl].float(), v[sl].float(), visibility_mask(torch.arange(n, device="cuda"), n),
                     192**-0.5)
        assert rel_err(out[sl], ref) < 1e-2
        start += n


def tiled_merge(partial_o, partial_lse, num_splits, max_splits, v_scale):
    """merge_splits_tiled over CPU-built partials `[B, H, S, Dv]` (float16: scaled rows of Dv + 8): (request, its
    split count n, its merged `[H, Dv]` on the CPU, the float64 LSE weights `[H, n]` of its first n splits) a
    request."""
    from attnserve.attention.kernels.merge_tiled import merge_splits_tiled

    v_dim = partial_o.shape[-1] - (8 if partial_o.dtype == torch.float16 else 0)
    out = torch.empty(*partial_lse.shape[:2], v_dim, device=DEVICE)
    merge_splits_tiled(out, partial_o.to(DEVICE), partial_lse.to(DEVICE), num_splits.to(DEVICE), max_splits, v_scale)
    out = out.cpu()
    for b, n in enumerate(num_splits.tolist()):
        yield b, n, out[b], torch.softmax(partial_lse[b, :, :n].double() * torch.log(torch.tensor(2.0)), dim=-1)


@pytest.mark.parametrize("max_splits", [130, 40])
def test_tiled_merge_weights_splits_by_their_lse(max_splits):
    """More splits than one tile holds (130 > 64) or all in one (40), a request with fewer, an empty split (LSE
    -inf), and a width that is not a multiple of the column tile: the exact LSE-weighted mean of the first
    num_splits partials."""
    gen = torch.Generator().manual_seed(0)
    partial_o = torch.randn(2, 3, max_splits, 80, generator=gen)  # [B, H, S, Dv]
    partial_lse = torch.randn(2, 3, max_splits, generator=gen) * 4  # [B, H, S], base 2
    partial_lse[0, 1, 7] = float("-inf")
    partial_o[1, :, 5:] = float("nan")  # request 1 has 5 splits: the rest is never read
    num_splits = torch.tensor([max_splits, 5], dtype=torch.int32)
    for b, n, out, w in tiled_merge(partial_o, partial_lse, num_splits, max_splits, 0.5):
        ref = torch.einsum("hs,hsd->hd", w, partial_o[b, :, :n].double()) * 0.5
        assert torch.allclose(out.double(), ref, atol=1e-5), b


@pytest.mark.parametrize("max_splits", [130, 40])
def test_tiled_merge_unscales_float16_partials(max_splits):
    """The column-split kernel's float16 partials: each row stored as partial x 2^k with k in its column Dv
    (rows of Dv + 8), here k from -20 to 20 over values far outside float16's own range; the merge undoes it."""
    gen = torch.Generator().manual_seed(1)
    partial_o = torch.randn(2, 3, max_splits, 80, generator=gen, dtype=torch.float64)  # [B, H, S, Dv]
    k = torch.randint(-20, 21, (2, 3, max_splits), generator=gen).double()  # [B, H, S]
    partial_o = partial_o * torch.exp2(-k)[..., None]  # 2^-20 .. 2^20 a row: stored, each is back near 1
    partial_lse = torch.randn(2, 3, max_splits, generator=gen) * 4  # [B, H, S], base 2
    stored = torch.zeros(2, 3, max_splits, 88, dtype=torch.float16)
    stored[..., :80] = (partial_o * torch.exp2(k)[..., None]).half()
    stored[..., 80] = k.half()
    num_splits = torch.tensor([max_splits, 5], dtype=torch.int32)
    for b, n, out, w in tiled_merge(stored, partial_lse, num_splits, max_splits, 1.0):
        ref = torch.einsum("hs,hsd->hd", w, partial_o[b, :, :n])
        scale = torch.einsum("hs,hsd->hd", w, partial_o[b, :, :n].abs())  # float16's error is relative to these
        assert ((out.double() - ref).abs() <= 2e-3 * scale + 1e-30).all(), b


# ---- extend as decode rows (one decode row per new token) -------------------------------------------
def test_extend_rows_plan_points_every_token_at_its_requests_pages():
    """Each token's row starts at its request's kv_indptr entry and sees its causal horizon; the split plan is
    decode's over those horizons (a long prefix under few tokens is split, many tokens are not)."""
    from attnserve.attention.kernels.mla.extend_rows import causal_horizons, plan_extend_rows

    prefix, ext = [0, 45, 70, 3], [2, 3, 1, 0]
    assert causal_horizons(prefix, ext).tolist() == [1, 2, 46, 47, 48, 71]
    sb = mla_batch(prefix, ext, page_size=16)
    meta = metadata_for_batch(sb.fb)
    plan = plan_extend_rows(prefix, ext, 16, DEVICE, 1, SplitPolicy(num_sms=4, min_split_tokens=16))
    owner = [0, 0, 1, 1, 1, 2]
    assert plan.kv_starts.tolist() == meta.kv_indptr[owner].tolist()
    assert plan.seq_lens.tolist() == [1, 2, 46, 47, 48, 71]
    assert plan.num_splits.tolist() == plan_kv_splits([1, 2, 46, 47, 48, 71], 1,
                                                      SplitPolicy(num_sms=4, min_split_tokens=16))
    assert plan.max_splits == max(plan.num_splits.tolist()) > 1
    many = plan_extend_rows([4096], [512], 1, DEVICE, 2, SplitPolicy(num_sms=132, waves=1.0))
    assert many.max_splits == 1 and many.kv_starts.unique().tolist() == [0] and many.token_groups is None


def test_extend_rows_token_groups_never_cross_a_request():
    """CTAs of 4 tokens (16 heads on the Gluon kernel's 64 rows): runs of one request, the last one short; a
    group's split count is its last token's (the longest horizon), given to each of its tokens."""
    from attnserve.attention.kernels.mla.extend_rows import plan_extend_rows, token_groups

    first, ntok = token_groups([5, 0, 3, 8], 4)
    assert first.tolist() == [0, 4, 5, 8, 12] and ntok.tolist() == [4, 1, 3, 4, 4]
    policy = SplitPolicy(num_sms=8, min_split_tokens=16)
    plan = plan_extend_rows([300, 0, 40, 2], [5, 0, 3, 8], 16, DEVICE, 1, policy, tokens=4)
    g_first, g_ntok, tokens = plan.token_groups
    assert tokens == 4 and g_first.tolist() == first.tolist() and g_ntok.tolist() == ntok.tolist()
    group_splits = plan_kv_splits([304, 305, 43, 6, 10], 1, policy)  # each group's last horizon
    assert plan.num_splits.tolist() == [s for s, n in zip(group_splits, ntok.tolist()) for _ in range(n)]
    assert plan.seq_lens.tolist() == [301, 302, 303, 304, 305, 41, 42, 43, 3, 4, 5, 6, 7, 8, 9, 10]


@pytest.mark.parametrize("page_size,kv_dtype,min_split_tokens", [(1, None, 256), (16, None, 16),
                                                                  (64, "fp8_e4m3", 16)])
def test_mla_extend_as_decode_rows_over_cached_prefixes(page_size, kv_dtype, min_split_tokens):
    """The same ragged batch as the tile kernel's test (fresh prompt, chunk over a prefix, one-token tail, an
    empty request), splits off and on: the oracle's causal extend. Unused latent rows are NaN, so a row that
    reads past its horizon or into another request shows."""
    from attnserve.attention.kernels.mla.extend_rows import mla_extend_rows_attention, plan_extend_rows

    sb = mla_batch([0, 45, 70, 3, 9], [9, 7, 1, 12, 0], page_size=page_size, heads=16, kv_dtype=kv_dtype, seed=4)
    fb, lay = sb.fb, sb.layer
    plan = plan_extend_rows(fb.prefix_lens_cpu, fb.extend_lens_cpu, page_size, DEVICE, 1,
                            SplitPolicy(num_sms=64, min_split_tokens=min_split_tokens))
    assert (plan.max_splits > 1) == (min_split_tokens == 16)
    out = torch.full((fb.num_tokens, lay.num_heads, LATENT), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    mla_extend_rows_attention(sb.q, sb.pool.kv_buffer[0], out, plan, metadata_for_batch(fb).kv_indices, lay.scaling,
                              plan_for_call(sb.q, sb.pool.kv_buffer[0], LATENT, page_size, SMALL),
                              kv_scale=sb.pool.k_scale[0])
    assert not out.isnan().any()
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-2
