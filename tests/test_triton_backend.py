"""The triton backend through the contract: plan, store, decode/extend via AttentionLayer, CUDA-graph buffers.

CPU: TRITON_INTERPRET=1, small shapes. GPU (marked gpu): real shapes and a real CUDA graph.
"""

import dataclasses
import subprocess
import sys

import pytest
import torch
from attention_helpers import poison_unused_slots, rel_err, run_layer, run_layer_step

from attnserve.attention.backends.triton.common import FEATURES, TritonStep
from attnserve.attention.base import AttentionRequirements, unsupported
from attnserve.batch import ForwardBatch, ForwardMode
from attnserve.choice.registry import backend_for_pool, get_spec
from attnserve.kvcache.pool import MHAKVPool, MLAKVPool
from attnserve.reference.attention import reference_for_batch
from attnserve.reference.synthetic import make_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# ---- features and registry -------------------------------------------------------------------------
def test_module_reads_features_without_importing_triton():
    code = ("import sys; from attnserve.choice.registry import get_spec; "
            "f = get_spec('triton').features; assert 'triton' not in sys.modules, 'triton imported'; print(f.cuda_graph)")
    res = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "True"


def test_features_declare_what_the_tests_below_exercise():
    f = get_spec("triton").features
    assert f == dataclasses.replace(FEATURES, expanded_mla_prefill=True)  # MHA's and MLA's, joined
    assert f.devices == frozenset({"cuda"}) and "triton" in f.required_packages
    assert {"bf16", "fp16", "fp8_e4m3"} <= f.kv_dtypes and f.page_sizes is None
    req = AttentionRequirements(page_size=16, kv_dtype="fp8_e4m3", sliding_window=True, attention_sinks=True,
                                logit_softcap=True, custom_mask=True, spec_topk=4)
    assert unsupported(f, req) == []
    assert unsupported(f, AttentionRequirements(attention_type="MLA", head_dim=576, v_head_dim=512, page_size=64,
                                                kv_dtype="fp8_e4m3")) == []


def test_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="kv_lora_rank 48"):
        backend_for_pool("triton", MLAKVPool(4, 1, 1, 48, 16, device=DEVICE))
    pool = MHAKVPool(4, 1, 1, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="unknown triton backend options"):
        backend_for_pool("triton", pool, num_splits=3)
    sb = make_batch([4], [1], num_heads=2, num_kv_heads=2, head_dim=16, device=DEVICE)
    backend = backend_for_pool("triton", sb.pool)
    with pytest.raises(ValueError, match="no decode plan"):  # metadata of a step planned as something else
        backend.forward_decode(sb.q, sb.layer, sb.fb, TritonStep())
    with pytest.raises(ValueError, match="init_graph_buffers"):
        backend.plan_for_replay(sb.fb)


# ---- decode -----------------------------------------------------------------------------------------
DECODE_CASES = {
    "mha-p1": {"page_size": 1, "num_heads": 4, "num_kv_heads": 4, "head_dim": 64},
    "gqa4-p4": {"page_size": 4, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64},
    "gqa8-p16-d128": {"page_size": 16, "num_heads": 16, "num_kv_heads": 2, "head_dim": 128},
    "d256-p16": {"page_size": 16, "num_heads": 4, "num_kv_heads": 2, "head_dim": 256},
    "d96-p1": {"page_size": 1, "num_heads": 4, "num_kv_heads": 1, "head_dim": 96},
    "gqa16-p16": {"page_size": 16, "num_heads": 16, "num_kv_heads": 1, "head_dim": 64},
    "fp8-p1": {"page_size": 1, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64, "kv_dtype": "fp8_e4m3"},
    "fp8-p16-gqa8": {"page_size": 16, "num_heads": 8, "num_kv_heads": 1, "head_dim": 64, "kv_dtype": "fp8_e4m3"},
    "fp8-e5m2-p4": {"page_size": 4, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64, "kv_dtype": "fp8_e5m2"},
    "window": {"page_size": 4, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64, "sliding_window": 24},
    "sinks": {"page_size": 1, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64, "use_sinks": True},
    "softcap": {"page_size": 16, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64, "logit_cap": 8.0},
    "fp32-asym-v": {"page_size": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "v_head_dim": 32, "dtype": torch.float32},
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_matches_oracle(case):
    kw = {"dtype": torch.bfloat16, "score_scale": 20.0, "seed": len(case)} | DECODE_CASES[case]
    sb = make_batch([45, 1, 130, 16], [1, 1, 1, 1], device=DEVICE, **kw)
    poison_unused_slots(sb)
    backend = backend_for_pool("triton", sb.pool, num_sms=64, min_split_tokens=16)  # several splits on short requests
    out, step = run_layer_step(sb, backend)
    assert step.decode.max_splits > 1
    assert not out.isnan().any()
    tol = 1e-4 if kw["dtype"] == torch.float32 else 1e-2
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < tol


def test_decode_with_a_custom_mask_runs_the_extend_kernel():
    sb = make_batch([20, 9], [1, 1], num_heads=4, num_kv_heads=2, head_dim=32, page_size=4, dtype=torch.bfloat16,
                    device=DEVICE, custom_mask=True, mode=ForwardMode.DECODE, seed=3)
    backend = backend_for_pool("triton", sb.pool)
    out, step = run_layer_step(sb, backend)
    assert step.decode is None and step.extend is not None
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-2


# ---- extend -----------------------------------------------------------------------------------------
EXTEND_CASES = {
    "prefill-mha-p1": {"prefix": [0, 0], "ext": [33, 7], "page_size": 1, "num_heads": 2, "num_kv_heads": 2, "head_dim": 64},
    "prefix-gqa4-p4": {"prefix": [40, 0, 5], "ext": [9, 21, 1], "page_size": 4, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64},
    "prefix-gqa8-p16-d128": {"prefix": [19, 50], "ext": [18, 5], "page_size": 16, "num_heads": 8, "num_kv_heads": 1,
                                 "head_dim": 128},
    "prefix-d256-p4": {"prefix": [21, 0], "ext": [11, 17], "page_size": 4, "num_heads": 4, "num_kv_heads": 2,
                       "head_dim": 256},
    "prefix-d80-p1": {"prefix": [9, 30], "ext": [20, 3], "page_size": 1, "num_heads": 4, "num_kv_heads": 2,
                      "head_dim": 80},
    "fp8-p16": {"prefix": [30, 3], "ext": [12, 20], "page_size": 16, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64,
                    "kv_dtype": "fp8_e4m3"},
    "window-p4": {"prefix": [37, 2], "ext": [21, 19], "page_size": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64,
                      "sliding_window": 10},
    "sinks-softcap-p1": {"prefix": [11, 0], "ext": [14, 25], "page_size": 1, "num_heads": 4, "num_kv_heads": 1, "head_dim": 64,
                             "use_sinks": True, "logit_cap": 6.0},
    "spec-verify-topk-p16": {"prefix": [35, 18], "ext": [8, 6], "page_size": 16, "num_heads": 4, "num_kv_heads": 2,
                                 "head_dim": 64, "custom_mask": True, "mode": ForwardMode.TARGET_VERIFY},
    "mixed-p4": {"prefix": [12, 30, 0], "ext": [1, 1, 20], "page_size": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64,
                     "mode": ForwardMode.MIXED},
    # MIXED steps split: the leading one-token rows through the decode kernel, the prompt chunks through extend
    "mixed-window-sinks-p1": {"prefix": [40, 7, 0, 25], "ext": [1, 1, 17, 9], "page_size": 1, "num_heads": 8,
                              "num_kv_heads": 2, "head_dim": 64, "sliding_window": 12, "use_sinks": True,
                              "mode": ForwardMode.MIXED},
    "mixed-fp8-softcap-p16": {"prefix": [33, 70, 18], "ext": [1, 1, 13], "page_size": 16, "num_heads": 4,
                              "num_kv_heads": 1, "head_dim": 64, "kv_dtype": "fp8_e4m3", "logit_cap": 6.0,
                              "mode": ForwardMode.MIXED},
    "mixed-only-one-token-rows-p4": {"prefix": [12, 30, 0], "ext": [1, 1, 1], "page_size": 4, "num_heads": 4,
                                     "num_kv_heads": 2, "head_dim": 64, "mode": ForwardMode.MIXED},
    "mixed-one-token-row-after-a-chunk": {"prefix": [9, 0, 21], "ext": [1, 14, 1], "page_size": 4, "num_heads": 4,
                                          "num_kv_heads": 2, "head_dim": 64, "mode": ForwardMode.MIXED},
}


@pytest.mark.parametrize("case", list(EXTEND_CASES))
def test_extend_matches_oracle(case):
    kw = {"dtype": torch.bfloat16, "score_scale": 20.0, "seed": len(case)} | EXTEND_CASES[case]
    prefix, ext = kw.pop("prefix"), kw.pop("ext")
    sb = make_batch(prefix, ext, device=DEVICE, **kw)
    poison_unused_slots(sb)
    out = run_layer(sb, backend_for_pool("triton", sb.pool))
    assert not out.isnan().any()
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-2


def test_a_mixed_step_runs_its_leading_decodes_through_the_decode_kernel():
    kw = {"page_size": 4, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64, "dtype": torch.bfloat16,
          "score_scale": 20.0, "mode": ForwardMode.MIXED, "device": DEVICE}
    prefix, ext = [29, 50, 3, 0, 11], [1, 1, 1, 16, 7]
    outs = {}
    for split in (True, False):
        sb = make_batch(prefix, ext, seed=3, **kw)
        backend = backend_for_pool("triton", sb.pool, split_mixed=split)
        outs[split], step = run_layer_step(sb, backend)
        assert step.mixed_decode_rows == (3 if split else 0)
        # only the prompt chunks were planned as an extend step
        assert step.extend.extend_lens == (ext[3:] if split else ext)
    ref = reference_for_batch(sb.q, sb.layer, sb.fb)
    assert rel_err(outs[True], ref) < 1e-2 and rel_err(outs[False], ref) < 1e-2
    # a plain extend step is not split
    sb = make_batch([5, 0], [1, 9], seed=4, **(kw | {"mode": ForwardMode.EXTEND}))
    _, step = run_layer_step(sb, backend_for_pool("triton", sb.pool))
    assert step.mixed_decode_rows == 0


def test_store_through_the_layer_quantises_like_the_pool():
    sb = make_batch([6, 3], [5, 4], num_heads=4, num_kv_heads=2, head_dim=32, page_size=4, dtype=torch.bfloat16,
                    kv_dtype="fp8_e4m3", device=DEVICE, seed=5)
    expected_k = sb.pool.k_buffer[0].clone()  # make_batch stored the new tokens with pool.store
    sb.pool.k_buffer[0][sb.fb.out_cache_loc] = 0  # forget them; the layer must write them again
    run_layer(sb, backend_for_pool("triton", sb.pool))
    assert torch.equal(sb.pool.k_buffer[0].float(), expected_k.float())


# ---- CUDA graphs ------------------------------------------------------------------------------------
def _decode_batch(sb, seq_lens: list[int]) -> ForwardBatch:
    """A decode batch over sb's requests with other lengths (their slots are already in req_to_token)."""
    rows = sb.fb.req_pool_indices.tolist()[: len(seq_lens)]
    return ForwardBatch.from_lengths(ForwardMode.DECODE, rows, [s - 1 for s in seq_lens], [1] * len(rows),
                                     sb.fb.req_to_token, sb.pool)


def _graph_scenario(max_bs=8):
    full = [70, 9, 41, 120]
    sb = make_batch([n - 1 for n in full], [1] * 4, num_heads=8, num_kv_heads=2, head_dim=64, page_size=4,
                    dtype=torch.bfloat16, device=DEVICE, score_scale=20.0, use_sinks=True, seed=11)
    backend = backend_for_pool("triton", sb.pool, num_sms=64, min_split_tokens=16)
    backend.init_graph_buffers(max_bs, max_bs)
    return sb, backend, full


def test_graph_buffers_replay_new_lengths_in_place():
    """Capture-time plan with short lengths, replay-time plans with others: same buffers, right answers."""
    sb, backend, full = _graph_scenario()
    capture_fb = _decode_batch(sb, [1, 1, 1, 1])
    meta = backend.plan_for_capture(capture_fb)
    captured = meta.decode
    addresses = (captured.meta.kv_indptr.data_ptr(), captured.meta.kv_indices.data_ptr(),
                 captured.seq_lens.data_ptr(), captured.num_splits.data_ptr())
    backend.forward_decode(sb.q, sb.layer, capture_fb, meta)  # what capture would record
    for lens in ([5, 9, 2, 77], full):
        fb = _decode_batch(sb, lens)
        meta = backend.plan_for_replay(fb)
        plan = meta.decode
        assert (plan.meta.kv_indptr.data_ptr(), plan.meta.kv_indices.data_ptr(), plan.seq_lens.data_ptr(),
                plan.num_splits.data_ptr()) == addresses
        assert plan.max_splits == captured.max_splits > 1
        out = backend.forward_decode(sb.q, sb.layer, fb, meta)
        ref = reference_for_batch(sb.q, sb.layer, fb)
        assert rel_err(out, ref) < 1e-2
        meta = backend.plan(fb)
        eager = backend.forward_decode(sb.q, sb.layer, fb, meta)
        assert (eager.float() - out.float()).abs().max().item() < 2e-2
    with pytest.raises(ValueError, match="never captured"):
        backend.plan_for_replay(_decode_batch(sb, [3, 3]))


@gpu
@needs_cuda
def test_gpu_cuda_graph_capture_then_replay_with_other_lengths():
    sb, backend, full = _graph_scenario()
    q_static = sb.q.clone()
    capture_fb = _decode_batch(sb, [1, 1, 1, 1])
    meta = backend.plan_for_capture(capture_fb)
    backend.forward_decode(q_static, sb.layer, capture_fb, meta)  # warm-up compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = backend.forward_decode(q_static, sb.layer, capture_fb, meta)
    for lens in ([5, 9, 2, 77], full):
        fb = _decode_batch(sb, lens)
        backend.plan_for_replay(fb)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(graph_out, reference_for_batch(sb.q, sb.layer, fb)) < 1e-2
        meta = backend.plan(fb)
        eager = backend.forward_decode(sb.q, sb.layer, fb, meta)
        assert (eager.float() - graph_out.float()).abs().max().item() < 2e-2


# ---- GPU, real shapes -------------------------------------------------------------------------------
@gpu
@needs_cuda
@pytest.mark.parametrize("page_size,kv_dtype", [(1, "bf16"), (16, "bf16"), (16, "fp8_e4m3")])
def test_gpu_decode_real_shapes(page_size, kv_dtype):
    lens = [4096, 1, 777, 2049, 8192, 100, 3000, 33]
    sb = make_batch([n - 1 for n in lens], [1] * len(lens), num_heads=32, num_kv_heads=8, head_dim=128,
                    page_size=page_size, dtype=torch.bfloat16, kv_dtype=kv_dtype, device="cuda", score_scale=20.0)
    poison_unused_slots(sb)
    out = run_layer(sb, backend_for_pool("triton", sb.pool))
    assert not out.isnan().any()
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb, compute_dtype=torch.float32)) < 1e-2


@gpu
@needs_cuda
@pytest.mark.parametrize("page_size,extra", [(1, {}), (16, {}), (16, {"sliding_window": 300, "use_sinks": True})])
def test_gpu_extend_real_shapes(page_size, extra):
    sb = make_batch([0, 1000, 0, 37], [1024, 512, 300, 700], num_heads=32, num_kv_heads=8, head_dim=128,
                    page_size=page_size, dtype=torch.bfloat16, device="cuda", score_scale=20.0, **extra)
    poison_unused_slots(sb)
    out = run_layer(sb, backend_for_pool("triton", sb.pool))
    assert not out.isnan().any()
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb, compute_dtype=torch.float32)) < 1e-2
