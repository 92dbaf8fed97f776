"""Padded decode replay, checked on the CPU: the graph runner's buffer handling without CUDA.

A stand-in "graph" re-runs the model on the runner's fixed buffers, so what is tested is
exactly what a replay would compute: real rows copied in, padded rows pointing at the
padding row and page, and the backend planned over the padded batch.
"""

import dataclasses

import torch
from engine_helpers import make_engine, prompts

from attnserve.attention.backends.torch_native import TorchNativeBackend
from attnserve.engine.cuda_graph import CudaGraphRunner, default_batch_sizes
from attnserve.engine.sampling_params import SamplingParams


class GraphableNative(TorchNativeBackend):
    features = dataclasses.replace(TorchNativeBackend.features, cuda_graph=True)

    def init_graph_buffers(self, max_bs, max_tokens):
        self.graph_max_bs = max_bs

    def plan_for_capture(self, fb):
        self.plan(fb)

    def plan_for_replay(self, fb):
        self.plan(fb)


class EagerGraph:
    """Stands in for torch.cuda.CUDAGraph: replay() recomputes into the captured output tensor."""

    def __init__(self, runner, bs):
        self.runner, self.bs = runner, bs

    def replay(self):
        r, bs = self.runner, self.bs
        fb = r._batch(bs, [int(x) for x in r.seq_lens[:bs].tolist()])
        r.outputs[bs].copy_(r.model(r.input_ids[:bs], r.positions[:bs], fb))


class CpuGraphRunner(CudaGraphRunner):
    def capture(self):
        self.backend.init_graph_buffers(self.max_bs, self.max_bs)
        vocab = self.model.config.vocab_size
        for bs in self.batch_sizes:
            self.graphs[bs] = EagerGraph(self, bs)
            self.outputs[bs] = torch.zeros(bs, vocab)  # [bs, vocab]
        return 0.0


def test_default_batch_sizes():
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_batch_sizes(64)[-3:] == [48, 56, 64]


def test_padded_replay_matches_eager_and_touches_only_the_padding_page():
    ps = prompts(7, seed=9)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)

    eager = make_engine(disable_radix_cache=True)
    ref = [eager.add_request(p, params) for p in ps]
    eager.run_until_done()

    e = make_engine(disable_radix_cache=True)
    p = e.parts
    backend = GraphableNative(p.pool)
    e.runner.backend = backend
    runner = CpuGraphRunner(p.model, backend, p.pool, p.req_pool, p.padding_row, [1, 2, 4, 8], p.device)
    runner.capture()
    e.runner.graph_runner = runner
    got = [e.add_request(q, params) for q in ps]
    e.run_until_done()
    assert e.runner.steps_graphed > 0
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert e.pages_leaked() == 0
    # padded rows wrote only slot 0 of the padding page; the padding row still points there
    assert int(p.req_pool.req_to_token[p.padding_row].abs().sum()) == 0
