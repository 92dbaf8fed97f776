"""FlexAttention backend against the float64 oracle: eager on the CPU, compiled on the GPU."""

import random
import warnings
import zlib

import pytest
import torch

from attnserve.attention.backends.flex import KV_BLOCK, FlexAttentionBackend
from attnserve.batch import ForwardMode
from attnserve.reference.attention import reference_for_batch
from attnserve.reference.synthetic import make_batch

FEATURES = {
    "plain": {},
    "window": {"sliding_window": 6},
    "softcap": {"logit_cap": 4.0},
    "sinks": {"use_sinks": True},
    "custom_mask": {"custom_mask": True, "mode": ForwardMode.TARGET_VERIFY},
    "v_wider": {"v_head_dim": 48},
}


def _run(sb, backend):
    meta = backend.plan(sb.fb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it is unfused
        return backend.forward(sb.q, sb.k, sb.v, sb.layer, sb.fb, meta)


def _rel_err(out, ref):
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _lengths(seed, decode):
    rng = random.Random(seed)
    bs = rng.randint(1, 4)
    prefix = [rng.randint(1 if decode else 0, 40) for _ in range(bs)]
    ext = [1] * bs if decode else [rng.randint(1, 13) for _ in range(bs)]
    return prefix, ext


def _cases(features, shapes):
    """Every (feature, page_size, decode) pair except custom masks on decode (they belong to verify steps)."""
    return [(f, p, d) for f in features for p, d in shapes if not (d and f == "custom_mask")]


@pytest.mark.parametrize("feature,page_size,decode", _cases(sorted(FEATURES), [(1, False), (4, True), (16, False)]))
def test_matches_oracle_on_cpu(feature, page_size, decode):
    prefix, ext = _lengths(zlib.crc32(f"{feature}-{page_size}".encode()) % 997, decode)
    sb = make_batch(prefix, ext, page_size=page_size, score_scale=1.0 if feature == "softcap" else 20.0,
                    seed=page_size, **FEATURES[feature])
    out = _run(sb, FlexAttentionBackend(sb.pool))
    assert out.shape == (sb.q.shape[0], sb.q.shape[1], sb.layer.v_head_dim)
    assert _rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-5


def test_block_mask_skips_blocks_no_request_owns():
    """Pages spread over a large pool: each query block lists only the KV blocks its requests use."""
    sb = make_batch([20, 3], [5, 2], page_size=16, extra_pages=60, seed=3)
    backend = FlexAttentionBackend(sb.pool)
    out = _run(sb, backend)
    kv_num_blocks, kv_indices = backend.plan(sb.fb).blocks
    total_blocks = -(-sb.pool.num_slots // KV_BLOCK)
    slots = torch.cat([sb.fb.req_to_token[r, :s].long() for r, s in zip([1, 2], sb.fb.seq_lens_cpu)])
    owned = set((slots // KV_BLOCK).tolist())
    listed = set(kv_indices[0, 0, 0, : int(kv_num_blocks[0, 0, 0])].tolist())
    assert listed == owned and len(owned) < total_blocks
    assert _rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-5


def test_rejects_mla_pool():
    sb = make_batch([4], [2], mla=(32, 16))
    with pytest.raises(ValueError, match="MLA"):
        FlexAttentionBackend(sb.pool)


def test_features_say_no_cuda_graphs():
    assert not FlexAttentionBackend.features.cuda_graph
    assert FlexAttentionBackend.features.devices >= {"cpu", "cuda"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("feature,page_size,decode",
                         _cases(["plain", "window", "custom_mask"], [(1, True), (16, False), (16, True)]))
def test_compiled_matches_oracle_on_gpu(feature, page_size, decode):
    rng = random.Random(page_size * 7 + decode)
    bs = rng.randint(2, 6)
    prefix = [rng.randint(1, 400) for _ in range(bs)]
    ext = [1] * bs if decode else [rng.randint(1, 150) for _ in range(bs)]
    sb = make_batch(prefix, ext, num_heads=16, num_kv_heads=4, head_dim=128, page_size=page_size,
                    dtype=torch.bfloat16, device="cuda", score_scale=4.0, **FEATURES[feature])
    backend = FlexAttentionBackend(sb.pool)
    assert backend.compile
    out = _run(sb, backend)
    ref = reference_for_batch(sb.q, sb.layer, sb.fb, compute_dtype=torch.float32)
    assert _rel_err(out, ref) < 1e-2


def _share_prefix(sb, shared_tokens):
    """Point every request's first `shared_tokens` positions at the first request's slots, as the radix cache does."""
    fb = sb.fb
    rows = fb.req_pool_indices.tolist()
    assert all(s - e >= shared_tokens for s, e in zip(fb.seq_lens_cpu, fb.extend_lens_cpu))
    for row in rows[1:]:
        fb.req_to_token[row, :shared_tokens] = fb.req_to_token[rows[0], :shared_tokens]
    return sb


@pytest.mark.parametrize("feature,page_size,decode",
                         [("plain", 1, False), ("plain", 4, True), ("window", 16, False), ("custom_mask", 4, False)])
def test_requests_sharing_prefix_pages_match_oracle(feature, page_size, decode):
    """Shared slots belong to every request that uses them: none may lose its prefix to another."""
    prefix = [40, 33, 48]
    ext = [1, 1, 1] if decode else [5, 9, 3]
    sb = make_batch(prefix, ext, page_size=page_size, score_scale=20.0, seed=11, **FEATURES[feature])
    _share_prefix(sb, 32)
    shared = sb.fb.req_to_token[1, :32]
    assert torch.equal(sb.fb.req_to_token[2, :32], shared) and torch.equal(sb.fb.req_to_token[3, :32], shared)
    out = _run(sb, FlexAttentionBackend(sb.pool))
    assert _rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-5


def test_rejects_slot_used_at_two_positions():
    """A slot's keys carry their position's rotation, so one slot at two positions is a bug upstream."""
    sb = make_batch([8, 8], [2, 2], seed=5)
    sb.fb.req_to_token[2, 3] = sb.fb.req_to_token[1, 4]
    with pytest.raises(ValueError, match="different positions"):
        FlexAttentionBackend(sb.pool).plan(sb.fb)
