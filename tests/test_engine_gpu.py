"""The engine on a GPU: CUDA graphs on/off and triton vs torch_native give the same greedy tokens.

The same scheduling behaviour (batching, cache, chunking, preemption) is covered on the
CPU in test_engine_scheduler.py; here the GPU-only paths are checked: graph capture with
padded replay, and the triton kernels inside the engine.
"""

import pytest
import torch
from engine_helpers import prompts, tiny_llama

from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine
from attnserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NEW = 16
PROMPTS = prompts(12, seed=5, shared_prefix=8, lo=4, hi=60)


_BUNDLE = None


def _model_on_cuda():
    """head_dim 32: the smallest the triton kernels take."""
    global _BUNDLE
    if _BUNDLE is None:
        _BUNDLE = tiny_llama(hidden=128, heads=4, kv_heads=2)
        _BUNDLE.model.to("cuda")
    return _BUNDLE


def _run(backend: str, graphs: bool, page_size: int = 1, **kw) -> tuple[list[list[int]], Engine]:
    settings = {"max_total_tokens": 4096, "disable_radix_cache": True, **kw}
    cfg = EngineConfig(device="cuda", dtype="fp32", attention_backend=backend, disable_cuda_graph=not graphs,
                       max_running_requests=16, cuda_graph_max_bs=16, chunked_prefill_size=32,
                       page_size=page_size, **settings)
    e = Engine(cfg, loaded=_model_on_cuda())
    reqs = []
    for i, p in enumerate(PROMPTS):  # staggered: a new request every step
        reqs.append(e.add_request(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)))
        e.step()
    e.run_until_done()
    assert e.pages_leaked() == 0
    return [r.output_ids for r in reqs], e


@needs_cuda
def test_piecewise_graphs_keep_the_eager_tokens():
    """Prompt-carrying steps (staggered arrivals: mixed steps, chunks of 32) replayed in pieces give the eager
    engine's greedy tokens, the triton backend attending between the pieces."""
    eager, _ = _run("triton", graphs=False)
    pieces, e = _run("triton", graphs=True, piecewise_cuda_graph_max_tokens=64)  # pieces are the GPU default
    assert e.runner.steps_piecewise > 0 and e.runner.piecewise.token_sizes == [64]
    assert any("piecewise token sizes" in line for line in e.parts.startup_lines)
    assert pieces == eager


@needs_cuda
def test_cuda_graphs_on_off_and_backends_agree():
    eager_native, _ = _run("torch_native", graphs=False)
    eager_triton, _ = _run("triton", graphs=False)
    graphed, e = _run("triton", graphs=True)
    assert e.runner.steps_graphed > 0  # decode steps really replayed graphs (with padding: 12 -> 16)
    assert eager_triton == eager_native
    assert graphed == eager_triton


@needs_cuda
def test_cuda_graphs_with_pages_and_preemption():
    ref, _ = _run("triton", graphs=False, page_size=4)
    got, e = _run("triton", graphs=True, page_size=4, disable_radix_cache=False)
    assert got == ref
    assert e.cache_stats()["hit_tokens"] > 0  # the shared 8-token prefix
    tiny, e = _run("triton", graphs=True, page_size=4, max_total_tokens=256, disable_radix_cache=False)
    assert e.scheduler.counters.preemptions > 0
    assert tiny == ref


@needs_cuda
def test_overlap_on_and_off_agree_on_the_gpu_and_launching_a_step_never_syncs():
    """Greedy tokens are the same with overlap on and off (graphs on); and launching a step (schedule,
    metadata, plan, graph replay or eager forward, sampling, the async copy of its tokens) makes no
    synchronizing CUDA call: the host's only wait is on the previous step's event, outside the launch."""
    off, _ = _run("triton", graphs=True, disable_overlap_schedule=True)
    on, _ = _run("triton", graphs=True)
    assert on == off
    e = Engine(EngineConfig(device="cuda", dtype="fp32", attention_backend="triton", max_running_requests=8,
                            cuda_graph_max_bs=8, max_total_tokens=4096, disable_radix_cache=True,
                            chunked_prefill_size=32),
               loaded=_model_on_cuda())
    reqs = [e.add_request(p, SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.8 if i % 2 else 0,
                                            seed=i, logprobs=2 if i == 3 else None))
            for i, p in enumerate(PROMPTS[:6])]
    e.step()  # the first launch allocates (pinned blocks, plans); what follows must not sync
    launch = e._launch

    def strict(in_flight):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(in_flight)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    e._launch = strict
    e.run_until_done()
    assert all(len(r.output_ids) == 30 for r in reqs) and e.pages_leaked() == 0
    assert e.runner.steps_graphed > 0 and e.scheduler.counters.mixed_steps + len(e.step_times.extend) > 0
