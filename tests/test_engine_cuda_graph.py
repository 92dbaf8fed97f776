"""Padded decode replay, checked on the CPU: the graph runner's buffer handling without CUDA.

A stand-in "graph" re-runs the model on the runner's fixed buffers, so what is tested is
exactly what a replay would compute: real rows copied in, padded rows pointing at the
padding row and page, and the backend planned over the padded batch.
"""

import dataclasses

import torch
from engine_helpers import make_engine, prompts

from attnserve.attention.backends.torch_native import TorchNativeBackend
from attnserve.attention.layer import attention_step
from attnserve.engine.cuda_graph import CudaGraphRunner, default_batch_sizes
from attnserve.engine.runner import ModelRunner
from attnserve.engine.sampling_params import SamplingParams
from attnserve.kvcache.allocator import PADDING_PAGE


class GraphableNative(TorchNativeBackend):
    features = dataclasses.replace(TorchNativeBackend.features, cuda_graph=True)

    def init_graph_buffers(self, max_bs, max_tokens):
        self.graph_max_bs = max_bs

    def plan_for_capture(self, fb):
        return self.plan(fb)

    def plan_for_replay(self, fb):
        return None  # EagerGraph.replay plans the step it reruns


def _kv_snapshot(pool) -> list[torch.Tensor]:
    return [b.clone() for b in (*pool.k_buffer, *pool.v_buffer)]  # each [num_slots, kv_heads, head_dim]


def _changed_pages(before, after, page_size) -> set[int]:
    pages = set()
    for old, new in zip(before, after):
        rows = (old != new).flatten(1).any(dim=1).nonzero().flatten()  # slots whose K or V changed
        pages.update(int(s) // page_size for s in rows)
    return pages


class EagerGraph:
    """Stands in for torch.cuda.CUDAGraph: replay() recomputes into the captured output tensor.

    Each padded replay also records every page whose K/V it changed outside the real rows' own
    new slots: padded rows may touch the padding page and nothing else.
    """

    def __init__(self, runner, bs):
        self.runner, self.bs = runner, bs

    def replay(self):
        r, bs = self.runner, self.bs
        buf = r.buffers[1]
        real = buf.req_pool_indices[:bs] != r.padding_row  # [bs]
        before = _kv_snapshot(r.pool)
        fb = r._batch(bs, 1, False, [int(x) for x in buf.seq_lens[:bs].tolist()])
        # a real graph holds its kernels; this rerun plans the step and goes through the layers
        with attention_step(r.backend, r.backend.plan(fb)):
            r.outputs[(bs, 1, False)].copy_(r.model(buf.input_ids[:bs], buf.positions[:bs], fb))
        if bool(real.all()):
            return
        r.padded_replays += 1
        own_pages = {int(s) // r.pool.page_size for s in buf.out_cache_loc[:bs][real]}
        r.stray_pages |= _changed_pages(before, _kv_snapshot(r.pool), r.pool.page_size) - own_pages


class CpuGraphRunner(CudaGraphRunner):
    def capture(self):
        self.padded_replays = 0
        self.stray_pages: set[int] = set()
        self.backend.init_graph_buffers(self.max_bs, self.max_bs)
        self._buffers(1)
        vocab = self.model.config.vocab_size
        for bs in self.batch_sizes:
            self.graphs[(bs, 1, False)] = EagerGraph(self, bs)
            self.outputs[(bs, 1, False)] = torch.zeros(bs, vocab)  # [bs, vocab]
        self.sizes[(1, False)] = self.batch_sizes
        return 0.0


def test_default_batch_sizes():
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_batch_sizes(64)[-3:] == [48, 56, 64]


def test_padded_replay_matches_eager_and_touches_only_the_padding_page():
    ps = prompts(7, seed=9)
    # different lengths: the batch shrinks step by step, so padded rows reuse rows real requests had
    params = [SamplingParams(max_new_tokens=4 + 2 * i, ignore_eos=True) for i in range(len(ps))]

    eager = make_engine(disable_radix_cache=True)
    ref = [eager.add_request(p, sp) for p, sp in zip(ps, params)]
    eager.run_until_done()

    e = make_engine(disable_radix_cache=True)
    kv, device = e.parts.kv, e.parts.model.device
    backend = GraphableNative(kv.pool)
    runner = CpuGraphRunner(e.parts.model.module, backend, kv.pool, kv.req_pool, kv.padding_row, [1, 2, 4, 8], device)
    runner.capture()
    e.runner = ModelRunner(e.parts.model.module, kv.pool, backend, kv.req_pool, device, graph_runner=runner)
    got = [e.add_request(q, sp) for q, sp in zip(ps, params)]
    e.run_until_done()
    assert e.runner.steps_graphed > 0
    assert runner.padded_replays > 0
    assert runner.stray_pages <= {PADDING_PAGE}, f"padded replays changed K/V of pages {runner.stray_pages}"
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert e.pages_leaked() == 0
    # padded rows wrote only slot 0 of the padding page; the padding row still points there
    assert int(kv.req_pool.req_to_token[kv.padding_row].abs().sum()) == 0
