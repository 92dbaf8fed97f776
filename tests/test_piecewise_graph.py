"""Piecewise CUDA graphs of prompt-carrying steps: a padded replay gives the eager step's tokens.

On the CPU the pieces are not captured: a stand-in re-runs the forward on the runner's fixed buffers, cut at
every attention call exactly where a capture would cut, and runs each layer's attention the way a replay does
(from the crossing buffers, over the step's real tokens, into the output buffer); the buffers, the padding,
the RoPE tables cut to the real tokens and the runner's use of the pieces are the real code. On a GPU (marked
gpu) real pieces are captured and replayed against the eager forward.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from engine_helpers import TINY_DEEPSEEK, make_engine, prompts, tiny_llama, tiny_model

from attnserve.attention.layer import attention_cut, attention_step
from attnserve.batch import ForwardBatch, ForwardMode
from attnserve.engine.piecewise_graph import (
    Bucket,
    Cut,
    PiecewiseGraphRunner,
    default_token_sizes,
    model_can_be_cut,
)
from attnserve.engine.sampling_params import SamplingParams

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class RerunPieces(PiecewiseGraphRunner):
    """Stands in for the captured pieces: the forward re-runs on the fixed buffers, cut where a capture cuts."""

    def _record(self, tokens):
        return Bucket(tokens, [], [], None, None)

    def _run_pieces(self, bucket, tokens, fb):
        self.replays.append((tokens, bucket.tokens))
        n = bucket.tokens

        def cut(layer, q, k, v, fb_, save_kv, rope):
            self._hand_over(layer, q, k, v)  # what the piece ending here copies out
            with attention_cut(None):
                self._attend(Cut(layer, save_kv, rope, k is not None, v is not None), tokens, fb)
            return self._output(layer, n)  # what the next piece reads

        with attention_cut(cut):
            return self.model.forward_hidden(self.input_ids[:n], self.positions[:n], self._capture_batch(n))


def test_default_token_sizes():
    assert default_token_sizes(100) == [64, 100]
    assert default_token_sizes(2048)[:9] == [64, 128, 192, 256, 320, 384, 448, 512, 640]
    assert default_token_sizes(2048)[-3:] == [1536, 1792, 2048]
    assert default_token_sizes(16) == [16]
    with pytest.raises(ValueError):
        default_token_sizes(0)


def test_mla_models_are_not_cut():
    assert model_can_be_cut(tiny_llama().model) is None
    assert "MLA" in model_can_be_cut(tiny_model(TINY_DEEPSEEK).model)
    with pytest.raises(ValueError, match="piecewise CUDA graphs: MLA"):
        RerunPieces(tiny_model(TINY_DEEPSEEK).model, None, None, None, 0, [8], torch.device("cpu"), torch.float32)


def _with_pieces(e, sizes):
    kv, model = e.parts.kv, e.parts.model
    runner = RerunPieces(model.module, e.runner.backend, kv.pool, kv.req_pool, kv.padding_row, sizes, model.device,
                         model.dtype)
    runner.replays = []
    runner.capture()
    e.runner.piecewise = runner
    return runner


@pytest.mark.parametrize("chunk", [None, 24], ids=["whole-prompts", "chunked-mixed"])
def test_padded_piece_replays_give_the_eager_tokens(chunk):
    ps = prompts(6, seed=3, lo=5, hi=30)
    params = [SamplingParams(max_new_tokens=5 + i, ignore_eos=True) for i in range(len(ps))]
    settings = dict(disable_radix_cache=True, chunked_prefill_size=chunk, max_num_batched_tokens=chunk or 0,
                    max_running_requests=8)

    eager = make_engine(**settings)
    ref = [eager.add_request(p, sp) for p, sp in zip(ps, params)]
    eager.run_until_done()

    e = make_engine(**settings)
    runner = _with_pieces(e, [8, 16, 64, 256])
    got = []
    for i, (p, sp) in enumerate(zip(ps, params)):  # requests join while others decode: mixed steps
        got.append(e.add_request(p, sp))
        e.step()
    e.run_until_done()
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert e.runner.steps_piecewise == len(runner.replays) > 0
    assert any(t < b for t, b in runner.replays), "no step was padded up to its bucket"
    assert e.stats()["mixed_steps"] > 0 if chunk else True
    assert e.pages_leaked() == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in (interpreted triton) of "
                    "test_engine_gpu.py::test_piecewise_graphs_keep_the_eager_tokens, which runs on a GPU instead")
def test_triton_mixed_steps_in_pieces_keep_greedy():
    """The triton backend (interpreted) runs each piece's attention: mixed steps split into the decode kernel's
    rows and the extend path's, read from the crossing buffers."""
    from attnserve.choice.registry import backend_for_pool

    ps = prompts(3, seed=7, lo=5, hi=14)
    params = [SamplingParams(max_new_tokens=4, ignore_eos=True) for _ in ps]
    ref = make_engine(disable_radix_cache=True, page_size=4)
    want = [ref.add_request(p, sp) for p, sp in zip(ps, params)]
    ref.run_until_done()

    e = make_engine(disable_radix_cache=True, page_size=4, max_running_requests=8, chunked_prefill_size=16,
                    max_num_batched_tokens=12)
    e.runner.backend = backend_for_pool("triton", e.parts.kv.pool)
    runner = _with_pieces(e, [8, 16])
    got = []
    for p, sp in zip(ps, params):
        got.append(e.add_request(p, sp))
        e.step()
    e.run_until_done()
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert e.stats()["mixed_steps"] > 0 and e.runner.steps_piecewise == len(runner.replays) > 0


def test_steps_past_the_largest_bucket_run_eagerly():
    e = make_engine(disable_radix_cache=True, chunked_prefill_size=None)
    runner = _with_pieces(e, [8])
    r = e.add_request(prompts(1, seed=5, lo=20, hi=21)[0], SamplingParams(max_new_tokens=3, ignore_eos=True))
    e.run_until_done()
    assert r.finished and runner.replays == [] and e.runner.steps_piecewise == 0


def test_replay_cuts_rope_and_buffers_to_the_real_tokens():
    """A 5-token step in a bucket of 8: attention sees 5 rows of q/k/v and 5 RoPE rows, the output rows past
    5 are never written by attention, and the hidden states returned are the step's 5 rows."""
    e = make_engine(disable_radix_cache=True)
    runner = _with_pieces(e, [8])
    seen = []
    real_attend = runner._attend

    def attend(cut, tokens, fb):
        seen.append((tokens, cut.rope.narrow(tokens).cos.shape[0] if cut.rope is not None else None))
        real_attend(cut, tokens, fb)

    runner._attend = attend
    kv = e.parts.kv
    row = kv.req_pool.alloc()
    pages = e.scheduler.allocator.alloc(1)
    kv.req_pool.write_at([row], [0], [torch.arange(5) + pages[0] * kv.pool.page_size])
    fb = ForwardBatch.from_lengths(ForwardMode.EXTEND, [row], [0], [5], kv.req_pool.req_to_token, kv.pool)
    ids = torch.tensor([3, 1, 4, 1, 5])
    with torch.inference_mode():
        meta = e.runner.backend.plan(fb)
        hidden, residual = runner.replay(ids, fb.positions, fb, meta)
        with attention_step(e.runner.backend, e.runner.backend.plan(fb)):
            ref_hidden, ref_residual = e.parts.model.module.forward_hidden(ids, fb.positions, fb)
    assert hidden.shape == ref_hidden.shape == (5, ref_hidden.shape[1])
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(residual, ref_residual, rtol=1e-5, atol=1e-5)
    assert seen and all(s == (5, 5) for s in seen)
    assert runner.input_ids[5:8].eq(0).all() and runner.positions[5:8].eq(0).all()


@gpu
@needs_cuda
def test_gpu_piece_replays_match_the_eager_forward():
    """Real pieces captured on the GPU: replays of several sizes (padded and exact) give the eager logits."""
    from attnserve.choice.registry import backend_for_pool
    from attnserve.kvcache.pool import ReqToTokenPool, make_pool

    model = tiny_llama(hidden=128, heads=4, kv_heads=2).model.to("cuda")  # head_dim 32: triton's smallest
    pool = make_pool(model.kv_cache_spec(), 16, 16, dtype=torch.float32, device="cuda")
    req_pool = ReqToTokenPool(4, 256, device="cuda")
    padding_row, row = req_pool.alloc(), req_pool.alloc()
    backend = backend_for_pool("triton", pool)
    runner = PiecewiseGraphRunner(model, backend, pool, req_pool, padding_row, [16, 64], torch.device("cuda"),
                                  torch.float32)
    runner.capture()
    assert len(runner.buckets[64].pieces) == len(runner.buckets[64].cuts) + 1 == 3  # two layers: three pieces
    req_pool.write_at([row], [0], [np.arange(16, 16 + 64)])  # pages 1..4
    g = torch.Generator().manual_seed(0)
    for n in (5, 16, 40, 64):
        fb = ForwardBatch.from_lengths(ForwardMode.EXTEND, [row], [0], [n], req_pool.req_to_token, pool)
        ids = torch.randint(0, 500, (n,), generator=g).to("cuda")
        with torch.inference_mode():
            hidden, residual = runner.replay(ids, fb.positions, fb, backend.plan(fb))
            got = model.compute_logits(hidden, None, residual)
            with attention_step(backend, backend.plan(fb)):
                ref = model(ids, fb.positions, fb)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_largest_piece_size_follows_the_flag_then_a_fixed_step_budget():

    from attnserve.engine.schedule_policy import StepBudget
    from attnserve.engine.startup import piecewise_max_tokens

    fixed, auto = StepBudget("fixed", 1024), StepBudget("auto")
    assert piecewise_max_tokens(SimpleNamespace(piecewise_cuda_graph_max_tokens=512), fixed) == 512
    assert piecewise_max_tokens(SimpleNamespace(piecewise_cuda_graph_max_tokens=None), fixed) == 1024
    assert piecewise_max_tokens(SimpleNamespace(piecewise_cuda_graph_max_tokens=None), auto) == 2048


def test_the_flags_reach_the_config():
    from attnserve.engine.config import EngineConfig

    c = EngineConfig(disable_piecewise_cuda_graph=True, piecewise_cuda_graph_max_tokens=1024)
    assert c.disable_piecewise_cuda_graph and c.piecewise_cuda_graph_max_tokens == 1024
    assert not EngineConfig().disable_piecewise_cuda_graph  # on by default where it can run


def test_where_the_pieces_run_and_the_budget_that_follows():
    """Pieces run by default on CUDA with graphs on, for models that can be cut; each other case says why
    not, and the GPU's default step budget follows (1024 with pieces, 2048 eager)."""
    from attnserve.engine.config import EngineConfig
    from attnserve.engine.schedule_policy import resolve_step_budget
    from attnserve.engine.startup import piecewise_off_reason

    def model(m, device="cuda"):
        return SimpleNamespace(device=torch.device(device), module=m)

    llama = tiny_llama().model
    assert piecewise_off_reason(EngineConfig(), model(llama)) is None
    assert piecewise_off_reason(EngineConfig(), model(llama, "cpu")) == "CPU"
    assert piecewise_off_reason(EngineConfig(disable_cuda_graph=True), model(llama)) == "--disable-cuda-graph"
    assert piecewise_off_reason(EngineConfig(disable_piecewise_cuda_graph=True), model(llama)) == \
        "--disable-piecewise-cuda-graph"
    assert "deterministic" in piecewise_off_reason(EngineConfig(enable_deterministic_inference=True), model(llama))
    assert "MLA" in piecewise_off_reason(EngineConfig(), model(tiny_model(TINY_DEEPSEEK).model))
    pieces, eager = resolve_step_budget(None, 64, "cuda", piecewise=True), resolve_step_budget(None, 64, "cuda")
    assert (pieces.tokens, eager.tokens) == (1024, 2048)
    assert "serve-budget-h100-piecewise.json" in pieces.reason
    assert resolve_step_budget(None, 64, "cpu", piecewise=True).tokens == 512
