"""KV pools: store/read in the pool layout, MLA latent view, FP8 round trips, bad input rejected whole."""

import pytest
import torch

from attnserve.kvcache.dtypes import canonical_kv_dtype, dtype_bytes, parse_kv_dtype
from attnserve.kvcache.pool import MHAKVPool, MLAKVPool, ReqToTokenPool

E4M3_REL_ERR = 2.0**-4  # 3 mantissa bits: round-to-nearest is within half a unit in the last place
E4M3_MAX = 448.0


def _buffers(pool):
    if pool.is_mla:
        return [b.clone() for b in pool.kv_buffer]
    return [b.clone() for b in pool.k_buffer + pool.v_buffer]


def _unchanged(pool, before):
    return all(torch.equal(a.float(), b.float()) for a, b in zip(before, _buffers(pool)))


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_store_then_read_through_pages(page_size):
    g = torch.Generator().manual_seed(page_size)
    pool = MHAKVPool(num_pages=8, page_size=page_size, num_layers=2, num_kv_heads=2, head_dim=16,
                     v_head_dim=8, dtype="fp32")
    pages = [5, 2, 7]
    slots = pool.slots_of_pages(pages)  # [3 * page_size]
    assert slots.tolist() == [p * page_size + o for p in pages for o in range(page_size)]
    n = slots.numel()
    k = torch.randn(n, 2, 16, generator=g)  # [n, kv_heads, head_dim]
    v = torch.randn(n, 2, 8, generator=g)  # [n, kv_heads, v_head_dim]
    pool.store(1, slots, k, v)
    assert torch.equal(pool.get_key_buffer(1)[slots], k)
    assert torch.equal(pool.get_value_buffer(1)[slots], v)
    assert pool.get_key_buffer(1).shape == (8 * page_size, 2, 16)
    assert pool.get_value_buffer(1).shape == (8 * page_size, 2, 8)
    others = torch.ones(pool.num_slots, dtype=torch.bool)
    others[slots] = False
    assert not pool.get_key_buffer(1)[others].any()  # nothing else touched
    assert not pool.get_key_buffer(0).any()  # nor another layer
    assert pool.bytes_per_token == 2 * 2 * (16 + 8) * 4


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp32"])
def test_half_precision_store_rounds_like_a_cast(kv_dtype):
    pool = MHAKVPool(4, 4, 1, 1, 8, dtype=kv_dtype)
    slots = torch.arange(4, 8)
    k = torch.randn(4, 1, 8)
    pool.store(0, slots, k, -k)
    dtype = parse_kv_dtype(kv_dtype)
    assert torch.equal(pool.get_key_buffer(0)[slots], k.to(dtype))
    assert torch.equal(pool.dequantize(pool.get_value_buffer(0)[slots], 1.0), (-k).to(dtype).float())


def test_mla_value_is_a_view_of_the_latent_columns():
    pool = MLAKVPool(num_pages=4, page_size=4, num_layers=2, kv_lora_rank=32, qk_rope_head_dim=8, dtype="fp32")
    slots = torch.tensor([4, 5, 13])
    latent = torch.randn(3, 1, 40)  # [tokens, 1, kv_lora_rank + rope_dim]
    pool.store(0, slots, latent)
    k = pool.get_key_buffer(0)
    v = pool.get_value_buffer(0)
    assert k.shape == (16, 1, 40) and v.shape == (16, 1, 32)
    assert torch.equal(k[slots], latent)
    assert torch.equal(v[slots], latent[..., :32])
    assert v.data_ptr() == k.data_ptr()  # a view, not a copy
    k[4, 0, 0] = 123.0
    assert v[4, 0, 0] == 123.0
    assert pool.bytes_per_token == 2 * 40 * 4


def test_mla_one_scale_serves_k_and_v():
    pool = MLAKVPool(4, 1, 1, 16, 4, dtype="fp8_e4m3")
    pool.set_scales(0, 0.5, 99.0)
    assert pool.k_scale[0] == pool.v_scale[0] == 0.5


@pytest.mark.parametrize("scale", [1.0, 0.05, 4.0])
def test_fp8_e4m3_round_trip_error_is_bounded(scale):
    g = torch.Generator().manual_seed(7)
    pool = MHAKVPool(8, 4, 1, 2, 32, dtype="fp8_e4m3")
    pool.set_scales(0, scale, scale * 2)
    slots = torch.arange(4, 28)
    k = torch.randn(24, 2, 32, generator=g) * scale * 20  # |k| / scale stays well below 448
    v = torch.randn(24, 2, 32, generator=g) * scale * 3
    pool.store(0, slots, k, v)
    assert pool.get_key_buffer(0).dtype == torch.float8_e4m3fn
    k_back = pool.dequantize(pool.get_key_buffer(0)[slots], pool.k_scale[0])
    v_back = pool.dequantize(pool.get_value_buffer(0)[slots], pool.v_scale[0])
    # relative error for normal numbers, plus half the subnormal spacing (2^-9) for tiny ones
    assert ((k_back - k).abs() <= E4M3_REL_ERR * k.abs() + 2.0**-10 * scale).all()
    assert ((v_back - v).abs() <= E4M3_REL_ERR * v.abs() + 2.0**-10 * scale * 2).all()
    assert (k_back - k).abs().max() > 0  # it really is lossy: the test would notice fp32 storage


def test_fp8_scale_extends_the_range_and_out_of_range_values_clamp():
    pool = MHAKVPool(4, 1, 1, 1, 4, dtype="fp8_e4m3")
    big = torch.tensor([[[1000.0, -1000.0, 200.0, 0.0]]])  # [1, 1, 4]
    pool.store(0, torch.tensor([1]), big, big)
    back = pool.dequantize(pool.get_key_buffer(0)[1], 1.0)
    assert back.tolist() == [[E4M3_MAX, -E4M3_MAX, 192.0, 0.0]]  # clamped; 200 rounds to 192
    pool.set_scales(0, 4.0, 4.0)
    pool.store(0, torch.tensor([2]), big, big)
    back = pool.dequantize(pool.get_key_buffer(0)[2], pool.k_scale[0])
    assert ((back - big[0]).abs() <= E4M3_REL_ERR * big[0].abs()).all()


def test_dtype_names():
    assert canonical_kv_dtype("bfloat16") == "bf16"
    assert canonical_kv_dtype(torch.float8_e4m3fn) == "fp8_e4m3"
    assert dtype_bytes("fp8_e5m2") == 1 and dtype_bytes("fp32") == 4
    with pytest.raises(ValueError, match="int3"):
        parse_kv_dtype("int3")
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        parse_kv_dtype(torch.int8)


@pytest.mark.parametrize("page_size", [0, 3, 6, -4, 2.0])
def test_page_size_must_be_a_power_of_two(page_size):
    with pytest.raises(ValueError, match="page_size"):
        MHAKVPool(4, page_size, 1, 1, 8)
    with pytest.raises(ValueError, match="page_size"):
        MLAKVPool(4, page_size, 1, 16, 4)


def test_unknown_dtype_and_bad_geometry():
    with pytest.raises(ValueError, match="fp6"):
        MHAKVPool(4, 1, 1, 1, 8, dtype="fp6")
    with pytest.raises(ValueError, match="None"):
        MHAKVPool(4, 1, 1, 1, 8, dtype=None)
    with pytest.raises(ValueError, match="num_pages"):
        MHAKVPool(1, 1, 1, 1, 8)
    pool = MHAKVPool(4, 1, 1, 1, 8)
    with pytest.raises(ValueError, match="positive"):
        pool.set_scales(0, 0.0, 1.0)


def _bad_stores():
    k = torch.randn(3, 2, 16)
    v = torch.randn(3, 2, 8)
    ok = torch.tensor([4, 5, 6])
    return {
        "k head_dim mismatch": (0, ok, torch.randn(3, 2, 8), v),
        "v head_dim mismatch": (0, ok, k, torch.randn(3, 2, 16)),  # k fine, v wrong: k must not land
        "kv heads mismatch": (0, ok, torch.randn(3, 4, 16), v),
        "token count mismatch": (0, torch.tensor([4, 5]), k, v),
        "loc not 1-d": (0, ok[None], k, v),
        "slot past the end": (0, torch.tensor([4, 5, 32]), k, v),  # two good slots, one bad
        "negative slot": (0, torch.tensor([-1, 5, 6]), k, v),
        "layer out of range": (2, ok, k, v),
        "float slots": (0, ok.float() + 0.5, k, v),
    }


@pytest.mark.parametrize("case", sorted(_bad_stores()))
def test_bad_store_raises_and_writes_nothing(case):
    pool = MHAKVPool(8, 4, 2, 2, 16, v_head_dim=8, dtype="fp32")
    before = _buffers(pool)
    layer, loc, k, v = _bad_stores()[case]
    with pytest.raises(ValueError) as info:
        pool.store(layer, loc, k, v)
    assert str(info.value)  # says what was wrong
    assert _unchanged(pool, before)


def test_bad_mla_store_raises_and_writes_nothing():
    pool = MLAKVPool(4, 2, 1, 16, 4, dtype="bf16")
    before = _buffers(pool)
    with pytest.raises(ValueError, match="20"):
        pool.store(0, torch.tensor([2, 3]), torch.randn(2, 1, 16))  # missing the rope columns
    with pytest.raises(ValueError, match="outside"):
        pool.store(0, torch.tensor([2, 8]), torch.randn(2, 1, 20))
    assert _unchanged(pool, before)


def test_req_to_token_rows():
    table = ReqToTokenPool(max_reqs=2, max_context_len=6)
    r0, r1 = table.alloc(), table.alloc()
    assert {r0, r1} == {0, 1}
    with pytest.raises(RuntimeError):
        table.alloc()
    table.extend([r1, r0], [[9, 8], [5]])
    table.extend([r1], [[7]])  # appended after what the row holds
    assert table.req_to_token[r1].tolist() == [9, 8, 7, 0, 0, 0] and table.filled(r1) == 3
    with pytest.raises(ValueError, match="max_context_len"):
        table.extend([r0, r1], [[4], [1, 2, 3, 4]])
    # the refused write left nothing, in either row
    assert table.req_to_token[r1].tolist() == [9, 8, 7, 0, 0, 0] and table.filled(r1) == 3
    assert table.req_to_token[r0].tolist() == [5, 0, 0, 0, 0, 0] and table.filled(r0) == 1
    table.free(r1)
    assert table.alloc() == r1 and table.filled(r1) == 0  # a reused row starts empty
    table.free(r0)
    with pytest.raises(ValueError, match="not allocated"):
        table.free(r0)
    assert table.num_free == 1
