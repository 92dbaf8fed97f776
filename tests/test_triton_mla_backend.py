"""The triton backend on MLA pools: through AttentionLayer, CUDA-graph buffers, and a tiny DeepSeek model.

CPU: TRITON_INTERPRET=1 with DeepSeek's shapes scaled down (latent 32 + rope 16).
"""

import pytest
import torch
from attention_helpers import rel_err, run_layer, run_layer_step
from engine_helpers import TINY_DEEPSEEK, VOCAB, tiny_model

from attnserve.attention.backends.torch_native import TorchNativeBackend
from attnserve.attention.backends.triton import TritonMLABackend
from attnserve.attention.kernels.mla.decode_table import MLADecodeConfig
from attnserve.attention.layer import attention_step
from attnserve.batch import ForwardBatch, ForwardMode
from attnserve.choice.registry import backend_for_pool
from attnserve.kvcache.pool import make_pool
from attnserve.reference.attention import reference_for_batch
from attnserve.reference.synthetic import make_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("page_size,kv_dtype", [(1, None), (64, "fp8_e4m3")])
def test_mla_decode_through_the_layer(page_size, kv_dtype):
    sb = make_batch([60, 1, 200, 17], [1] * 4, num_heads=16, mla=(32, 16), page_size=page_size,
                    dtype=torch.bfloat16, kv_dtype=kv_dtype, device=DEVICE, score_scale=8.0)
    backend = backend_for_pool("triton", sb.pool, num_sms=8, min_split_tokens=16)  # several splits on short requests
    out, step = run_layer_step(sb, backend)
    assert step.decode.max_splits > 1 and backend._head_groups == 1
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-2


def test_mla_extend_through_the_layer_with_prefixes():
    sb = make_batch([0, 40, 9], [20, 13, 1], num_heads=3, mla=(32, 16), page_size=4, dtype=torch.bfloat16,
                    device=DEVICE, score_scale=8.0, mode=ForwardMode.EXTEND)
    out = run_layer(sb, backend_for_pool("triton", sb.pool))
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-2


@pytest.mark.parametrize("rows", [None, True, False])
def test_mla_extend_takes_decode_rows_where_asked_and_says_which_path_ran(rows):
    """Default: decode rows only where the Gluon kernel runs (not on a CPU, nor for this 32 + 16 latent on a
    GPU); True forces them (on the Triton decode kernel here), False never; the oracle's output either way."""
    from attnserve.attention.kernels.resolve import gluon_blocker

    sb = make_batch([0, 40, 9], [12, 9, 1], num_heads=16, mla=(32, 16), page_size=4, dtype=torch.bfloat16,
                    device=DEVICE, score_scale=8.0, mode=ForwardMode.EXTEND)
    backend = backend_for_pool("triton", sb.pool, mla_extend_rows=rows, num_sms=64, min_split_tokens=16)
    out, step = run_layer_step(sb, backend)
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-2
    why_not_gluon = gluon_blocker(backend._signature(16, sb.q.dtype))
    expected = {None: f"mla tiles ({why_not_gluon})", True: "mla decode rows (triton, 1 token a CTA)",
                False: "mla tiles (decode rows off)"}[rows]
    assert step.extend_path == expected
    if rows:
        assert step.extend.mla_rows[0].max_splits > 1  # a 40-token prefix under 9 tokens is split


def test_mla_extend_rows_forced_under_a_custom_mask_says_why():
    sb = make_batch([12, 5], [4, 3], num_heads=2, mla=(32, 16), dtype=torch.bfloat16, device=DEVICE,
                    custom_mask=True, mode=ForwardMode.TARGET_VERIFY, score_scale=8.0)
    with pytest.raises(ValueError, match="does not apply to this call: custom mask"):
        run_layer(sb, backend_for_pool("triton", sb.pool, mla_extend_rows=True))


def test_mla_head_groups_learnt_at_the_first_layer_replan_the_splits():
    """40 heads are 3 groups of 16: three programs per split, so fewer splits than with one."""
    sb = make_batch([300, 250], [1, 1], num_heads=40, mla=(32, 16), dtype=torch.bfloat16, device=DEVICE,
                    score_scale=8.0)
    backend = backend_for_pool("triton", sb.pool, num_sms=4, min_split_tokens=16,
                            mla_decode_config=MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1))
    meta = backend.plan(sb.fb)
    before = meta.decode.max_splits
    with attention_step(backend, meta):
        out = sb.layer(sb.q, sb.k, None, sb.fb).view(2, 40, 32)
    assert backend._head_groups == 3 and meta.decode.max_splits < before
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-2


@pytest.mark.parametrize("given", [False, True])
def test_an_mla_tiles_split_waves_replan_unless_the_backend_was_given_some(given):
    """A tile with split_waves 0.5 halves the target programs: fewer splits than the default 2 waves; an explicit
    split_waves option wins over the tile's."""
    sb = make_batch([300, 250], [1, 1], num_heads=16, mla=(32, 16), dtype=torch.bfloat16, device=DEVICE,
                    score_scale=8.0)
    tile = MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
    default = backend_for_pool("triton", sb.pool, num_sms=8, min_split_tokens=16, mla_decode_config=tile)
    _, default_step = run_layer_step(sb, default)
    options = {"split_waves": 2.0} if given else {}
    backend = backend_for_pool("triton", sb.pool, num_sms=8, min_split_tokens=16,
                            mla_decode_config=MLADecodeConfig(16, 16, 4, 1, split_waves=0.5), **options)
    out, step = run_layer_step(sb, backend)
    assert backend.split_policy.waves == (2.0 if given else 0.5)
    if given:
        assert step.decode.max_splits == default_step.decode.max_splits
    else:
        assert 1 < step.decode.max_splits < default_step.decode.max_splits
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-2


def test_mla_graph_buffers_replay_new_lengths_in_place():
    full = [70, 9, 41, 120]
    sb = make_batch([n - 1 for n in full], [1] * 4, num_heads=16, mla=(32, 16), page_size=4, dtype=torch.bfloat16,
                    device=DEVICE, score_scale=8.0, seed=2)
    backend = backend_for_pool("triton", sb.pool, num_sms=8, min_split_tokens=16)
    backend.init_graph_buffers(8, 8)
    rows = sb.fb.req_pool_indices.tolist()

    def batch(lens):
        return ForwardBatch.from_lengths(ForwardMode.DECODE, rows, [n - 1 for n in lens], [1] * 4,
                                         sb.fb.req_to_token, sb.pool)

    meta = backend.plan_for_capture(batch([1, 1, 1, 1]))
    assert meta.decode.max_splits > 1
    for lens in ([5, 9, 2, 77], full):
        fb = batch(lens)
        meta = backend.plan_for_replay(fb)
        out = backend.forward_decode(sb.q, sb.layer, fb, meta)
        assert rel_err(out, reference_for_batch(sb.q, sb.layer, fb)) < 1e-2


# ---- a tiny DeepSeek model end to end ----------------------------------------------------------------


@torch.no_grad()
def greedy(model, prompts, make_backend, page_size, new_tokens, chunk):
    """Chunked prefill (`chunk` tokens per step, so later chunks read a cached prefix), then greedy decode."""
    spec = model.kv_cache_spec()
    device = next(model.parameters()).device
    lengths = [len(p) + new_tokens for p in prompts]
    pages = [-(-n // page_size) for n in lengths]
    pool = make_pool(spec, sum(pages) + 1, page_size, dtype=torch.float32, device=device)
    req_to_token = torch.zeros(len(prompts), max(lengths), dtype=torch.int32, device=device)  # [B, max_len]
    first_page = 1
    for row, (n, p) in enumerate(zip(lengths, pages)):
        req_to_token[row, :n] = pool.slots_of_pages(list(range(first_page, first_page + p)))[:n].to(torch.int32)
        first_page += p
    backend = make_backend(pool)
    rows = list(range(len(prompts)))
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)
    last_logits = [None] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):  # chunked prefill of every prompt together
        ext = [min(chunk, len(p) - d) for d, p in zip(done, prompts)]
        live = [i for i, e in enumerate(ext) if e > 0]
        fb = ForwardBatch.from_lengths(ForwardMode.EXTEND, [rows[i] for i in live], [done[i] for i in live],
                                       [ext[i] for i in live], req_to_token, pool)
        ids = torch.tensor([t for i in live for t in prompts[i][done[i]: done[i] + ext[i]]], device=device)  # [T]
        with attention_step(backend, backend.plan(fb)):
            logits = model(ids, fb.positions, fb, logits_indices=None)
        ends = torch.tensor([ext[i] for i in live], device=device).cumsum(0) - 1
        for i, e in zip(live, ends.tolist()):
            done[i] += ext[i]
            last_logits[i] = logits[e]
    for i in rows:
        tokens[i].append(int(last_logits[i].argmax()))
    for _ in range(new_tokens - 1):
        seq = [len(t) for t in tokens]
        fb = ForwardBatch.from_lengths(ForwardMode.DECODE, rows, [s - 1 for s in seq], [1] * len(rows),
                                       req_to_token, pool)
        with attention_step(backend, backend.plan(fb)):
            logits = model(torch.tensor([t[-1] for t in tokens], device=device), fb.positions, fb)
        for i, tok in enumerate(logits.argmax(-1).tolist()):
            tokens[i].append(tok)
    return [t[len(p):] for t, p in zip(tokens, prompts)]


def test_tiny_deepseek_greedy_tokens_through_triton_equal_torch_native():
    page_size = 4  # pages of 1 and 64 are the kernel tests'; here requests span several pages
    model = tiny_model(TINY_DEEPSEEK, seed=3).model.to(DEVICE)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (11, 23, 5)]
    ref = greedy(model, prompts, TorchNativeBackend, page_size, new_tokens=6, chunk=8)
    expanded_calls = []

    class CountingTriton(TritonMLABackend):
        def forward_expanded_prefill(self, q, k, v, layer, fb, meta):
            expanded_calls.append(meta.extend.extend_lens)
            return super().forward_expanded_prefill(q, k, v, layer, fb, meta)

    got = greedy(model, prompts, lambda pool: CountingTriton(pool, num_sms=4, min_split_tokens=8), page_size,
                 new_tokens=6, chunk=8)
    assert got == ref
    # the first chunk (fresh prompts) ran expanded in both layers; later chunks read a prefix, absorbed
    assert expanded_calls == [[8, 8, 5]] * 2


# ---- GPU, DeepSeek's real widths ----------------------------------------------------------------------
@gpu
@needs_cuda
@pytest.mark.parametrize("page_size,kv_dtype,heads", [(1, "bf16", 128), (64, "bf16", 16), (64, "fp8_e4m3", 128)])
def test_gpu_mla_decode_real_shapes(page_size, kv_dtype, heads):
    lens = [4096, 1, 777, 2049, 100, 33]
    sb = make_batch([n - 1 for n in lens], [1] * len(lens), num_heads=heads, mla=(512, 64), page_size=page_size,
                    dtype=torch.bfloat16, kv_dtype=kv_dtype, device="cuda", score_scale=2.0)
    out = run_layer(sb, backend_for_pool("triton", sb.pool))
    assert not out.isnan().any()
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb, compute_dtype=torch.float32)) < 1e-2


@gpu
@needs_cuda
@pytest.mark.parametrize("page_size", [1, 64])
def test_gpu_mla_extend_real_shapes(page_size):
    sb = make_batch([0, 1000, 37], [512, 256, 300], num_heads=16, mla=(512, 64), page_size=page_size,
                    dtype=torch.bfloat16, device="cuda", score_scale=2.0)
    out = run_layer(sb, backend_for_pool("triton", sb.pool))
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb, compute_dtype=torch.float32)) < 1e-2


@gpu
@needs_cuda
def test_gpu_mla_cuda_graph_capture_then_replay_with_other_lengths():
    full = [700, 9, 4100, 120]
    sb = make_batch([n - 1 for n in full], [1] * 4, num_heads=128, mla=(512, 64), page_size=64,
                    dtype=torch.bfloat16, device="cuda", score_scale=2.0)
    backend = backend_for_pool("triton", sb.pool)
    run_layer(sb, backend)  # eager step first: the head groups are learnt
    backend.init_graph_buffers(8, 8)
    rows = sb.fb.req_pool_indices.tolist()

    def batch(lens):
        return ForwardBatch.from_lengths(ForwardMode.DECODE, rows, [n - 1 for n in lens], [1] * 4,
                                         sb.fb.req_to_token, sb.pool)

    capture_fb = batch([1, 1, 1, 1])
    meta = backend.plan_for_capture(capture_fb)
    q_static = sb.q.clone()
    backend.forward_decode(q_static, sb.layer, capture_fb, meta)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = backend.forward_decode(q_static, sb.layer, capture_fb, meta)
    for lens in ([5, 9, 2, 77], full):
        fb = batch(lens)
        backend.plan_for_replay(fb)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(graph_out, reference_for_batch(sb.q, sb.layer, fb, compute_dtype=torch.float32)) < 1e-2
