"""Decode CUDA graphs: capture one graph per batch size, replay padded to the next captured size.

Inputs live in fixed-address buffers sized for the largest batch. Padded rows
point at the reserved padding row of the request->slot table (all zeros, i.e.
slot 0 of padding page 0) with sequence length 1, so they read and write only
the padding page. The backend's plan runs outside the graph, before replay
(`plan_for_replay`), rewriting its own fixed buffers in place.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from attnserve.attention.base import AttentionBackend, ForwardBatch, ForwardMode
from attnserve.kvcache.pool import KVPool, ReqToTokenPool

log = logging.getLogger("attnserve.engine")


def default_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 32 beyond; capped at max_bs."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 257, 16)) + list(range(288, 1025, 32))
    out = [s for s in sizes if s <= max_bs]
    if out[-1] != max_bs:
        out.append(max_bs)
    return out


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        pool: KVPool,
        req_pool: ReqToTokenPool,
        padding_row: int,
        batch_sizes: list[int],
        device: torch.device,
    ):
        if not backend.features.cuda_graph:
            raise ValueError(f"attention backend {backend.name} does not support CUDA graphs")
        self.model = model
        self.backend = backend
        self.pool = pool
        self.req_pool = req_pool
        self.padding_row = padding_row
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.device = device
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)  # [max_bs]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # [max_bs]
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=device)  # [max_bs], 0 = padding slot
        self.req_pool_indices = torch.full((n,), padding_row, dtype=torch.int64, device=device)  # [max_bs]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)  # [max_bs]
        self.extend_lens = torch.ones(n, dtype=torch.int32, device=device)  # [max_bs]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0

    def _batch(self, bs: int, seq_lens_cpu: list[int]) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            extend_lens=self.extend_lens[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_to_token=self.req_pool.req_to_token,
            pool=self.pool,
            attn_backend=self.backend,
            seq_lens_cpu=seq_lens_cpu,
            extend_lens_cpu=[1] * bs,
        )

    def capture(self) -> float:
        """Capture every batch size, largest first (smaller graphs reuse its memory pool)."""
        start = time.perf_counter()
        self.backend.init_graph_buffers(self.max_bs, self.max_bs)
        mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.device)
        with torch.inference_mode():
            # one eager step first: some backends learn per-layer facts from it before they can capture
            fb = self._batch(self.max_bs, [1] * self.max_bs)
            self.backend.plan(fb)
            self.model(self.input_ids, self.positions, fb)
            for bs in reversed(self.batch_sizes):
                fb = self._batch(bs, [1] * bs)
                self.backend.plan_for_capture(fb)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm up: autotuning and lazy init must happen outside capture
                        self.model(self.input_ids[:bs], self.positions[:bs], fb)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mempool, stream=stream):
                    out = self.model(self.input_ids[:bs], self.positions[:bs], fb)
                self.graphs[bs] = graph
                self.outputs[bs] = out
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        return self.capture_seconds

    def can_run(self, bs: int) -> bool:
        return 0 < bs <= self.max_bs

    def replay(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: list[int],
    ) -> torch.Tensor:
        """Logits `[bs, vocab]` of a decode step, run through the graph of the next captured size."""
        with torch.inference_mode():  # the backend's graph buffers were made under inference mode
            return self._replay(input_ids, positions, out_cache_loc, req_pool_indices, seq_lens, seq_lens_cpu)

    def _replay(self, input_ids, positions, out_cache_loc, req_pool_indices, seq_lens, seq_lens_cpu):
        bs = len(seq_lens_cpu)
        gbs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]
        self.input_ids[:bs].copy_(input_ids)
        self.positions[:bs].copy_(positions)
        self.out_cache_loc[:bs].copy_(out_cache_loc)
        self.req_pool_indices[:bs].copy_(req_pool_indices)
        self.seq_lens[:bs].copy_(seq_lens)
        if gbs > bs:
            self.input_ids[bs:gbs].zero_()
            self.positions[bs:gbs].zero_()
            self.out_cache_loc[bs:gbs].zero_()
            self.req_pool_indices[bs:gbs].fill_(self.padding_row)
            self.seq_lens[bs:gbs].fill_(1)
        fb = self._batch(gbs, list(seq_lens_cpu) + [1] * (gbs - bs))
        self.backend.plan_for_replay(fb)
        self.graphs[gbs].replay()
        return self.outputs[gbs][:bs]
