"""The oracles against each other and against torch's softmax and SDPA."""

import math

import pytest
import torch
import torch.nn.functional as F
from streaming_oracles import flash_attention_forward, merge_attention_states, online_softmax

from attnserve.batch import ForwardMode
from attnserve.reference.attention import (
    attend,
    paged_attention_reference,
    reference_for_batch,
    visibility_mask,
)
from attnserve.reference.synthetic import make_batch

f64 = torch.float64


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=f64) * scale


def _sdpa(q, k, v, mask=None, causal=False, scale=None):
    """q [M, H, D], k/v [N, H, D] -> [M, H, Dv] through torch's SDPA (heads first)."""
    q, k, v = q.to(f64), k.to(f64), v.to(f64)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, is_causal=causal, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("chunk", [1, 7, 16, 100])
@pytest.mark.parametrize("score_scale", [1.0, 20.0])
def test_online_softmax_matches_softmax(chunk, score_scale):
    x = _rand(3, 5, 37, seed=chunk, scale=score_scale)
    x[0, 0, :20] = -math.inf  # a masked stretch longer than a chunk
    assert torch.allclose(online_softmax(x, chunk), torch.softmax(x, -1), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("m,n,block_m,block_n", [(37, 37, 16, 16), (5, 53, 4, 7), (64, 64, 64, 64), (1, 29, 8, 8)])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_forward_matches_sdpa_and_logsumexp(m, n, block_m, block_n, causal):
    q = _rand(m, 3, 16, seed=1, scale=20.0)  # peaked softmax: a missing rescale would show
    k = _rand(n, 3, 16, seed=2)
    v = _rand(n, 3, 24, seed=3)  # V wider than K
    scale = 16**-0.5
    o, lse = flash_attention_forward(q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n)
    mask = visibility_mask(torch.arange(n - m, n), n, causal=causal)  # queries are the last m positions
    ref = _sdpa(q, k, v, mask=mask, scale=scale)
    assert torch.allclose(o, ref, atol=1e-10)
    scores = torch.einsum("mhd,nhd->mhn", q, k) * scale
    scores = scores.masked_fill(~mask[:, None, :], -math.inf)
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-10)


def test_merging_two_halves_equals_the_whole():
    q = _rand(9, 4, 32, seed=4, scale=20.0)
    k = _rand(50, 4, 32, seed=5)
    v = _rand(50, 4, 16, seed=6)
    whole, lse_whole = flash_attention_forward(q, k, v, causal=False, block_m=4, block_n=8)
    for split in (1, 13, 49):
        o1, l1 = flash_attention_forward(q, k[:split], v[:split], causal=False, block_m=4, block_n=8)
        o2, l2 = flash_attention_forward(q, k[split:], v[split:], causal=False, block_m=4, block_n=8)
        merged, lse = merge_attention_states(o1, l1, o2, l2)
        assert torch.allclose(merged, whole, atol=1e-10)
        assert torch.allclose(lse, lse_whole, atol=1e-10)


def test_merging_with_an_empty_side_returns_the_other():
    o = _rand(3, 2, 8, seed=7)
    lse = _rand(3, 2, seed=8)
    empty_o, empty_lse = torch.zeros_like(o), torch.full_like(lse, -math.inf)
    for merged, merged_lse in (merge_attention_states(o, lse, empty_o, empty_lse),
                               merge_attention_states(empty_o, empty_lse, o, lse)):
        assert torch.allclose(merged, o) and torch.allclose(merged_lse, lse)


@pytest.mark.parametrize("group", [1, 4])
def test_attend_gqa_window_and_custom_mask_match_sdpa(group):
    hkv = 2
    q = _rand(6, hkv * group, 16, seed=9, scale=20.0)
    k = _rand(20, hkv, 16, seed=10)
    v = _rand(20, hkv, 8, seed=11)
    q_pos = torch.arange(14, 20)
    g = torch.Generator().manual_seed(12)
    custom = torch.rand(6, 20, generator=g) < 0.5
    custom[torch.arange(6), q_pos] = True
    for mask in (visibility_mask(q_pos, 20), visibility_mask(q_pos, 20, sliding_window=5),
                 visibility_mask(q_pos, 20, custom_mask=custom)):
        out = attend(q, k, v, mask, scale=0.25)
        ref = _sdpa(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), mask=mask, scale=0.25)
        assert torch.allclose(out, ref, atol=1e-10)
    window = visibility_mask(q_pos, 20, sliding_window=5)
    assert window.sum(1).tolist() == [5] * 6  # the window counts the query itself


def test_attend_soft_cap_and_sinks_match_their_definitions():
    q = _rand(4, 2, 8, seed=13, scale=20.0)
    k = _rand(10, 2, 8, seed=14)
    v = _rand(10, 2, 8, seed=15)
    mask = visibility_mask(torch.arange(6, 10), 10)
    sinks = torch.tensor([0.5, 3.0], dtype=f64)
    scores = torch.einsum("mhd,nhd->hmn", q, k) * 0.3
    capped = 30.0 * torch.tanh(scores / 30.0)
    # a sink is one more logit per head whose value row is zero
    with_sink = torch.cat([capped.masked_fill(~mask[None], -math.inf),
                           sinks[:, None, None].expand(2, 4, 1)], -1)
    p = torch.softmax(with_sink, -1)[..., :-1]
    ref = torch.einsum("hmn,nhd->mhd", p, v)
    out = attend(q, k, v, mask, scale=0.3, logit_cap=30.0, sinks=sinks)
    assert torch.allclose(out, ref, atol=1e-10)
    assert (capped.abs() <= 30.0).all() and scores.abs().max() > 30.0  # the cap did something


def test_fully_masked_rows_give_zeros():
    q, k, v = _rand(2, 1, 4, seed=16), _rand(3, 1, 4, seed=17), _rand(3, 1, 4, seed=18)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    assert torch.equal(attend(q, k, v, mask, scale=1.0), torch.zeros(2, 1, 4, dtype=f64))


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("gqa", [1, 4])
def test_paged_reference_matches_sdpa_per_request(page_size, gqa):
    prefix, extend = [0, 13, 30, 7], [11, 1, 5, 16]
    sb = make_batch(prefix, extend, num_heads=2 * gqa, num_kv_heads=2, head_dim=32, page_size=page_size,
                    score_scale=20.0, seed=page_size + gqa)
    fb, layer = sb.fb, sb.layer
    out = reference_for_batch(sb.q, layer, fb)
    k_buf, v_buf = sb.pool.get_key_buffer(0), sb.pool.get_value_buffer(0)
    t0 = 0
    for row, p, e in zip(fb.req_pool_indices.tolist(), prefix, extend):
        slots = fb.req_to_token[row, : p + e].long()
        k = k_buf[slots].repeat_interleave(gqa, 1)
        v = v_buf[slots].repeat_interleave(gqa, 1)
        mask = torch.ones(e, p + e, dtype=torch.bool).tril(diagonal=p)  # causal with a cached prefix
        ref = _sdpa(sb.q[t0 : t0 + e], k, v, mask=mask, scale=layer.scaling)
        assert torch.allclose(out[t0 : t0 + e], ref, atol=1e-10)
        t0 += e
    # the new tokens' K/V went into the pool where out_cache_loc says
    assert torch.equal(k_buf[fb.out_cache_loc], sb.k)


def test_paged_reference_decode_equals_flash_forward():
    prefix = [40, 3, 17]
    sb = make_batch(prefix, [1, 1, 1], num_heads=4, num_kv_heads=4, head_dim=16, page_size=4,
                    seed=3)
    assert sb.fb.mode is ForwardMode.DECODE
    out = reference_for_batch(sb.q, sb.layer, sb.fb)
    for i, (row, p) in enumerate(zip(sb.fb.req_pool_indices.tolist(), prefix)):
        slots = sb.fb.req_to_token[row, : p + 1].long()
        o, _ = flash_attention_forward(sb.q[i : i + 1].to(f64), sb.pool.get_key_buffer(0)[slots].to(f64),
                                       sb.pool.get_value_buffer(0)[slots].to(f64), causal=True,
                                       scale=sb.layer.scaling, block_m=1, block_n=7)
        assert torch.allclose(out[i], o[0], atol=1e-10)


def test_mla_reference_is_mha_over_the_shared_latent():
    rank, rope = 32, 8
    sb = make_batch([5, 12], [3, 1], num_heads=6, mla=(rank, rope), page_size=4, seed=5)
    out = reference_for_batch(sb.q, sb.layer, sb.fb)
    assert out.shape == (4, 6, rank)
    latent = sb.pool.get_key_buffer(0)
    t0 = 0
    for row, p, e in zip(sb.fb.req_pool_indices.tolist(), [5, 12], [3, 1]):
        rows = latent[sb.fb.req_to_token[row, : p + e].long()]  # [N, 1, rank + rope]
        k = rows.expand(-1, 6, -1)
        v = rows[..., :rank].expand(-1, 6, -1)
        mask = torch.ones(e, p + e, dtype=torch.bool).tril(diagonal=p)
        ref = _sdpa(sb.q[t0 : t0 + e], k, v, mask=mask, scale=sb.layer.scaling)
        assert torch.allclose(out[t0 : t0 + e], ref, atol=1e-10)
        t0 += e


def test_fp8_pool_is_read_back_with_its_scales():
    sb = make_batch([9], [3], num_heads=2, num_kv_heads=1, head_dim=16, kv_dtype="fp8_e4m3", seed=6)
    pool, fb = sb.pool, sb.fb
    assert (pool.k_scale[0], pool.v_scale[0]) == (0.5, 0.25)
    out = reference_for_batch(sb.q, sb.layer, fb)
    slots = fb.req_to_token[1, :12].long()
    k = pool.get_key_buffer(0)[slots].to(f64) * 0.5
    v = pool.get_value_buffer(0)[slots].to(f64) * 0.25
    mask = torch.ones(3, 12, dtype=torch.bool).tril(diagonal=9)
    ref = _sdpa(sb.q.to(f64), k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), mask=mask,
                scale=sb.layer.scaling)
    assert torch.allclose(out, ref, atol=1e-10)


def test_paged_reference_without_causality_sees_everything():
    sb = make_batch([4], [4], num_heads=1, num_kv_heads=1, head_dim=8, seed=8)
    out = paged_attention_reference(sb.q.to(f64), sb.pool.get_key_buffer(0), sb.pool.get_value_buffer(0),
                                    sb.fb.req_to_token, [1], [8], [4], scale=0.5, causal=False)
    slots = sb.fb.req_to_token[1, :8].long()
    ref = _sdpa(sb.q, sb.pool.get_key_buffer(0)[slots], sb.pool.get_value_buffer(0)[slots], scale=0.5)
    assert torch.allclose(out, ref, atol=1e-10)
