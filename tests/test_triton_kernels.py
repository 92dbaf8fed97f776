"""The Triton kernels one by one against the oracles: KV store, split-KV decode + merge, extend.

On the CPU these run under TRITON_INTERPRET=1 with small shapes; with CUDA they run compiled.
"""

import pytest
import torch
from attention_helpers import poison_unused_slots, rel_err

from attnserve.attention.kernels.mha.decode import DecodeConfig, decode_attention
from attnserve.attention.kernels.mha.extend import ExtendConfig, build_extend_tiles, extend_attention
from attnserve.attention.kernels.params import DecodeRows, ExtendRows, LayerParams
from attnserve.attention.kernels.split_plan import SplitPolicy, max_splits_for_batch, plan_kv_splits
from attnserve.attention.kernels.store import store_kv
from attnserve.attention.metadata import metadata_for_batch
from attnserve.kvcache.pool import MHAKVPool
from attnserve.reference.attention import reference_for_batch
from attnserve.reference.synthetic import make_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ---- KV store -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3", "fp8_e5m2"])
def test_store_kv_matches_pool_store(kv_dtype):
    g = torch.Generator().manual_seed(1)
    ours = MHAKVPool(8, 4, 1, 2, 64, v_head_dim=32, dtype=kv_dtype, device=DEVICE)
    theirs = MHAKVPool(8, 4, 1, 2, 64, v_head_dim=32, dtype=kv_dtype, device=DEVICE)
    if ours.is_fp8:
        for p in (ours, theirs):
            p.set_scales(0, 0.5, 0.25)
    # k and v as strided views of one fused projection, values wide enough to hit the fp8 clamp
    fused = (torch.randn(7, 2, 96, generator=g) * 200).to(torch.bfloat16).to(DEVICE)  # [T, H, 64 + 32]
    k, v = fused[..., :64], fused[..., 64:]
    loc = torch.tensor([5, 9, 3, 30, 31, 12, 4], device=DEVICE)
    store_kv(ours.k_buffer[0], ours.v_buffer[0], loc, k, v, ours.k_scale[0], ours.v_scale[0])
    theirs.store(0, loc, k, v)
    assert torch.equal(ours.k_buffer[0].float(), theirs.k_buffer[0].float())
    assert torch.equal(ours.v_buffer[0].float(), theirs.v_buffer[0].float())


def test_store_kv_rejects_mismatched_shapes():
    pool = MHAKVPool(4, 1, 1, 2, 16, dtype="bf16", device=DEVICE)
    k = torch.zeros(3, 2, 16, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="k shape"):
        store_kv(pool.k_buffer[0], pool.v_buffer[0], torch.arange(3, device=DEVICE), k[:, :1], k)
    with pytest.raises(ValueError, match="out_cache_loc"):
        store_kv(pool.k_buffer[0], pool.v_buffer[0], torch.arange(2, device=DEVICE), k, k)


# ---- split plan (host only) -----------------------------------------------------------------------
def test_split_plan_fills_the_gpu_for_one_long_request_and_not_for_a_big_batch():
    policy = SplitPolicy(num_sms=132, waves=2.0, min_split_tokens=256, max_splits=64)
    one_long = plan_kv_splits([32768], num_kv_heads=8, policy=policy)
    assert one_long[0] * 8 >= 132  # at least one program per SM
    big_batch = plan_kv_splits([1024] * 256, num_kv_heads=8, policy=policy)
    assert set(big_batch) == {1}
    ragged = plan_kv_splits([8192, 512, 0], num_kv_heads=8, policy=policy)
    assert ragged[0] > ragged[1] >= 1 and ragged[2] == 1
    assert all(s <= 3 for s in plan_kv_splits([100000], 8, policy, max_splits=3))
    assert plan_kv_splits([1000], 8, SplitPolicy(num_sms=1000, min_split_tokens=300)) == [4]


def test_graph_split_dimension_shrinks_with_batch():
    policy = SplitPolicy(num_sms=132)
    dims = [max_splits_for_batch(bs, 8, policy) for bs in (1, 4, 16, 64)]
    assert dims == sorted(dims, reverse=True) and dims[0] > 1 and dims[-1] == 1
    with pytest.raises(ValueError, match="waves"):
        SplitPolicy(waves=0)


# ---- decode ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size,block_n", [(1, 16), (4, 32), (16, 16)])
def test_decode_kernel_with_forced_splits(page_size, block_n):
    """Every split count from 1 to more splits than tiles (empty splits) gives the oracle's answer."""
    sb = make_batch([45, 3, 100, 17], [1, 1, 1, 1], num_heads=8, num_kv_heads=2, head_dim=64,
                    page_size=page_size, dtype=torch.bfloat16, device=DEVICE, score_scale=20.0, seed=page_size)
    poison_unused_slots(sb)
    fb, layer = sb.fb, sb.layer
    meta = metadata_for_batch(fb)
    ref = reference_for_batch(sb.q, layer, fb)
    outs = []
    for splits in ([1, 1, 1, 1], [3, 1, 5, 2], [7, 7, 7, 7]):
        out = torch.full((4, 8, 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)  # [B, Hq, Dv]
        num_splits = torch.tensor(splits, dtype=torch.int32, device=DEVICE)
        rows = DecodeRows(meta.kv_indptr, meta.kv_indices, fb.seq_lens, num_splits, max(splits), page_size)
        decode_attention(sb.q, sb.pool.k_buffer[0], sb.pool.v_buffer[0], out, rows, LayerParams(layer.scaling),
                         write_final=False, config=DecodeConfig(block_n=block_n, num_warps=4, num_stages=1))
        assert not out.isnan().any()
        assert rel_err(out, ref) < 1e-2
        outs.append(out)
    # the direct (one split, no merge) path agrees with the merged one
    direct = torch.full_like(outs[0], float("nan"))
    rows = DecodeRows(meta.kv_indptr, meta.kv_indices, fb.seq_lens, torch.ones(4, dtype=torch.int32, device=DEVICE),
                      1, page_size)
    decode_attention(sb.q, sb.pool.k_buffer[0], sb.pool.v_buffer[0], direct, rows, LayerParams(layer.scaling),
                     write_final=True, config=DecodeConfig(block_n=block_n, num_warps=4, num_stages=1))
    assert (direct.float() - outs[0].float()).abs().max().item() <= 1e-2


# ---- extend ----------------------------------------------------------------------------------------
def test_extend_tiles_cover_every_row_heaviest_first():
    tiles = build_extend_tiles([0, 100, 5], [40, 3, 17], positions=16, device="cpu")
    covered = sorted(zip(tiles.tile_req.tolist(), tiles.tile_m0.tolist()))
    assert covered == [(0, 0), (0, 16), (0, 32), (1, 0), (2, 0), (2, 16)]
    assert tiles.tile_req.tolist()[0] == 1  # 100 cached tokens: the most keys to sweep


@pytest.mark.parametrize(("block_m", "block_n", "pack_gqa", "group"),
                         [(16, 16, False, 2), (32, 16, True, 4), (16, 32, True, 2), (64, 16, True, 3),
                          (16, 16, False, 1)])
def test_extend_kernel_block_shapes(block_m, block_n, pack_gqa, group):
    """Tiles that do not divide the lengths, on both sides of the causal diagonal, heads packed or not."""
    sb = make_batch([0, 29, 6], [37, 11, 18], num_heads=2 * group, num_kv_heads=2, head_dim=64, page_size=4,
                    dtype=torch.bfloat16, device=DEVICE, score_scale=20.0, seed=block_m + block_n, use_sinks=True)
    poison_unused_slots(sb)
    fb, layer = sb.fb, sb.layer
    meta = metadata_for_batch(fb)
    cfg = ExtendConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=1, pack_gqa=pack_gqa)
    tiles = build_extend_tiles(fb.prefix_lens_cpu, fb.extend_lens_cpu, cfg.positions_per_tile(group), DEVICE)
    out = torch.full((sb.q.shape[0], 2 * group, 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)  # [T, Hq, Dv]
    extend_attention(sb.q, sb.pool.k_buffer[0], sb.pool.v_buffer[0], out,
                     ExtendRows(tiles, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, fb.seq_lens, 4),
                     LayerParams(layer.scaling, sinks=layer.sinks), config=cfg)
    assert not out.isnan().any()
    assert rel_err(out, reference_for_batch(sb.q, layer, fb)) < 1e-2


def test_extend_rejects_tiles_built_for_another_block():
    sb = make_batch([0], [8], num_heads=2, num_kv_heads=2, head_dim=16, device=DEVICE)
    meta = metadata_for_batch(sb.fb)
    tiles = build_extend_tiles([0], [8], 32, DEVICE)
    with pytest.raises(ValueError, match="positions"):
        extend_attention(sb.q, sb.pool.k_buffer[0], sb.pool.v_buffer[0], torch.empty_like(sb.q),
                         ExtendRows(tiles, meta.qo_indptr, meta.kv_indptr, meta.kv_indices, sb.fb.seq_lens, 1),
                         LayerParams(1.0), config=ExtendConfig(block_m=16, block_n=16))
