"""Decode and speculative-verify CUDA graphs, replayed padded to the next captured batch size.

One graph per (batch size, q tokens per request, chain or tree): decode is q = 1; a verify step
(`capture_verify`, as SGLang captures its target-verify graphs) runs exactly q tokens a request, its last
token then its drafts, and the graph returns the logits of all of them. Both are captured, replayed and
padded by the same code. Inputs live in fixed-address buffers per q, sized for the largest batch. A padded
request points at the reserved padding row of the request->slot table (all zeros, i.e. slot 0 of padding
page 0) with sequence length q, so its tokens read and write only the padding page, however small the page.
The backend's plan runs outside the graph, before replay (`plan_for_replay`), rewriting its own fixed
buffers in place. A chain is causal and passes no mask; a tree passes its compact mask `[bs, q, q]` over
the new tokens (the prefix is visible to every row), which fits a fixed buffer whatever the prefixes.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from attnserve.attention.base import AttentionBackend
from attnserve.attention.layer import attention_step
from attnserve.batch import ForwardBatch, ForwardMode
from attnserve.graph_capture import collector_paused_for_capture
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


# the most tokens a captured verify step holds: its logits alone are tokens x vocab floats per graph, so larger
# verify batches run eagerly
VERIFY_GRAPH_MAX_TOKENS = 1024


def verify_batch_sizes(decode_sizes: list[int], tokens_per_req: int,
                       max_tokens: int = VERIFY_GRAPH_MAX_TOKENS) -> list[int]:
    """The decode graphs' batch sizes whose verify step of tokens_per_req tokens each fits max_tokens."""
    cap = max(1, max_tokens // tokens_per_req)
    return [s for s in decode_sizes if s <= cap] or [min(decode_sizes)]


@dataclass
class GraphBuffers:
    """The fixed-address inputs of every graph of one width q, the tokens a request runs per step: 1 for decode,
    1 + drafts for verify."""

    q: int
    input_ids: torch.Tensor  # [max_bs * q] int64
    positions: torch.Tensor  # [max_bs * q] int64
    out_cache_loc: torch.Tensor  # [max_bs * q] int64, 0 = the padding slot
    req_pool_indices: torch.Tensor  # [max_bs] int64
    seq_lens: torch.Tensor  # [max_bs] int32, KV length after the step
    extend_lens: torch.Tensor  # [max_bs] int32, all q
    tree_mask: torch.Tensor  # [max_bs, q, q] bool, True = may attend (among the request's new tokens)

    @classmethod
    def allocate(cls, max_bs: int, q: int, padding_row: int, device) -> GraphBuffers:
        n = max_bs * q
        return cls(
            q=q,
            input_ids=torch.zeros(n, dtype=torch.int64, device=device),
            positions=torch.zeros(n, dtype=torch.int64, device=device),
            out_cache_loc=torch.zeros(n, dtype=torch.int64, device=device),
            req_pool_indices=torch.full((max_bs,), padding_row, dtype=torch.int64, device=device),
            seq_lens=torch.full((max_bs,), q, dtype=torch.int32, device=device),
            extend_lens=torch.full((max_bs,), q, dtype=torch.int32, device=device),
            # a chain's mask to start with: every row of a captured batch sees itself and the rows before it
            tree_mask=torch.ones(q, q, dtype=torch.bool, device=device).tril().expand(max_bs, q, q).contiguous(),
        )

    def pad_all(self, padding_row: int) -> None:
        """Every request on the padding row and page, as a capture needs: replays leave real requests here."""
        for t in (self.input_ids, self.positions, self.out_cache_loc):
            t.zero_()
        self.req_pool_indices.fill_(padding_row)
        self.seq_lens.fill_(self.q)

    def fill(self, bs: int, graph_bs: int, padding_row: int, input_ids, positions, out_cache_loc,
             req_pool_indices, seq_lens, tree_mask) -> None:
        """Copy a step's bs requests in and point requests bs..graph_bs at the padding row and page."""
        q = self.q
        n, gn = bs * q, graph_bs * q
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.out_cache_loc[:n].copy_(out_cache_loc)
        self.req_pool_indices[:bs].copy_(req_pool_indices)
        self.seq_lens[:bs].copy_(seq_lens)
        if tree_mask is not None:
            self.tree_mask[:bs].copy_(tree_mask)  # padded requests keep any mask: their rows are never read
        if graph_bs > bs:
            self.input_ids[n:gn].zero_()
            self.positions[n:gn].zero_()
            self.out_cache_loc[n:gn].zero_()
            self.req_pool_indices[bs:graph_bs].fill_(padding_row)
            self.seq_lens[bs:graph_bs].fill_(q)


GraphKey = tuple[int, int, bool]  # (batch size, q tokens a request, tree mask): (bs, 1, False) is decode


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
        max_tokens: int = 0,
    ):
        """batch_sizes: the decode graphs'. max_tokens: the most tokens a verify graph captured later will hold
        (batch x q; 0: none). The backend hears it in init_graph_buffers before the first capture, as one that
        sizes scratch its graphs keep (FlashInfer's workspace) must hold the largest step then."""
        if not backend.features.cuda_graph:
            raise ValueError(f"attention backend {backend.name} does not support CUDA graphs")
        self.model = model
        self.backend = backend
        self.pool = pool
        self.req_pool = req_pool
        self.padding_row = padding_row
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.max_tokens = max(self.max_bs, max_tokens)
        self.device = device
        self.buffers: dict[int, GraphBuffers] = {}  # per width q
        self.sizes: dict[tuple[int, bool], list[int]] = {}  # (q, tree) -> captured batch sizes
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}  # the logits each graph's replays write, [bs * q, vocab]
        self.capture_seconds = 0.0
        self._mempool = None
        self._stream: torch.cuda.Stream | None = None

    def _buffers(self, q: int) -> GraphBuffers:
        if q not in self.buffers:
            self.buffers[q] = GraphBuffers.allocate(self.max_bs, q, self.padding_row, self.device)
        return self.buffers[q]

    def _batch(self, bs: int, q: int, tree: bool, seq_lens_cpu: list[int]) -> ForwardBatch:
        """The step a graph of (bs, q, tree) runs, over its width's buffers: a decode step when q is 1, else a
        verify step."""
        buf = self.buffers[q]
        return ForwardBatch(
            mode=ForwardMode.DECODE if q == 1 else ForwardMode.TARGET_VERIFY,
            req_pool_indices=buf.req_pool_indices[:bs],
            seq_lens=buf.seq_lens[:bs],
            extend_lens=buf.extend_lens[:bs],
            positions=buf.positions[: bs * q],
            out_cache_loc=buf.out_cache_loc[: bs * q],
            req_to_token=self.req_pool.req_to_token,
            pool=self.pool,
            seq_lens_cpu=seq_lens_cpu,
            extend_lens_cpu=[q] * bs,
            # the compact tree mask `[bs, q, q]` over the new tokens (module docstring), flattened like the
            # contract's masks (with no prefix, as at capture, the two are the same)
            custom_mask=buf.tree_mask[:bs].reshape(-1) if tree else None,
        )

    def _record(self, run) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm `run` up outside capture, then capture it: (the graph, the tensor its replays write).

        Every graph of this runner shares one memory pool; captures go largest first so that smaller graphs
        reuse its memory.
        """
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(device=self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: autotuning and lazy init must happen outside capture
                run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool, stream=stream):
            out = run()
        torch.cuda.synchronize(self.device)
        return graph, out

    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch, meta) -> torch.Tensor:
        """The model over one step, its attention on this runner's backend over the step's metadata (what
        plan or plan_for_capture returned: a captured graph keeps the buffers it points at)."""
        with attention_step(self.backend, meta):
            return self.model(input_ids, positions, fb)

    def _capture(self, q: int, tree: bool, sizes: list[int]) -> float:
        """Graphs of width q at these batch sizes, largest first (smaller graphs reuse its memory pool)."""
        start = time.perf_counter()
        buf = self._buffers(q)
        buf.pad_all(self.padding_row)
        with torch.inference_mode(), collector_paused_for_capture():
            # one eager step first: some backends learn per-layer facts from it before they can capture (the
            # verify side of a hybrid may not have run a step yet)
            fb = self._batch(sizes[-1], q, tree, [q] * sizes[-1])
            n = sizes[-1] * q
            self._run_model(buf.input_ids[:n], buf.positions[:n], fb, self.backend.plan(fb))
            for bs in reversed(sizes):
                fb = self._batch(bs, q, tree, [q] * bs)
                meta = self.backend.plan_for_capture(fb)
                ids, pos = buf.input_ids[: bs * q], buf.positions[: bs * q]
                # the warm-up also builds the backend's tile lists; the logits are every token's [bs * q, vocab]
                self.graphs[(bs, q, tree)], self.outputs[(bs, q, tree)] = self._record(
                    lambda ids=ids, pos=pos, fb=fb, meta=meta: self._run_model(ids, pos, fb, meta))
        self.sizes[(q, tree)] = sizes
        seconds = time.perf_counter() - start
        self.capture_seconds += seconds
        return seconds

    def capture(self) -> float:
        """Capture the decode graphs, one per batch size."""
        self.backend.init_graph_buffers(self.max_bs, self.max_tokens)
        return self._capture(1, False, self.batch_sizes)

    def capture_verify(self, tokens_per_req: int, tree: bool, batch_sizes: list[int] | None = None) -> float:
        """Capture verify graphs of q = tokens_per_req tokens per request (a chain, or a tree with its mask).

        Call after `capture()` (the backend's graph buffers exist then). `batch_sizes` defaults to the decode
        sizes; none may exceed the decode graphs' largest. Raises what the backend raises when it cannot plan
        a verify graph (the caller then verifies eagerly), e.g. FlashInfer when batch x q exceeds the
        `max_tokens` this runner was built with and its workspace cannot hold the step.
        """
        q = tokens_per_req
        if q < 2:
            raise ValueError(f"a verify step runs a request's last token and at least one draft, got q={q}")
        sizes = sorted(set(batch_sizes or self.batch_sizes))
        if sizes[0] < 1 or sizes[-1] > self.max_bs:
            raise ValueError(f"verify batch sizes {sizes} must lie in [1, {self.max_bs}]")
        return self._capture(q, tree, sizes)

    def can_run(self, bs: int, tokens_per_req: int = 1, tree: bool = False) -> bool:
        """Whether a graph holds a step of bs requests of tokens_per_req tokens each (1: decode)."""
        sizes = self.sizes.get((tokens_per_req, tree))
        return bool(sizes) and 0 < bs <= sizes[-1]

    def replay(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: list[int],
        tokens_per_req: int = 1,
        tree_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits `[bs * q, vocab]` of every token of a decode (q = 1) or verify step, through the graph of the
        next captured batch size.

        input_ids / positions / out_cache_loc `[bs * q]` int64, req_pool_indices `[bs]` int64, seq_lens `[bs]`
        int32 (the KV length after the step), tree_mask bool `[bs, q, q]` or None (decode, or a chain).
        """
        with torch.inference_mode():  # the backend's graph buffers were made under inference mode
            q, tree, bs = tokens_per_req, tree_mask is not None, len(seq_lens_cpu)
            sizes = self.sizes[(q, tree)]
            gbs = sizes[bisect.bisect_left(sizes, bs)]
            self.buffers[q].fill(bs, gbs, self.padding_row, input_ids, positions, out_cache_loc, req_pool_indices,
                                 seq_lens, tree_mask)
            self.backend.plan_for_replay(self._batch(gbs, q, tree, list(seq_lens_cpu) + [q] * (gbs - bs)))
            self.graphs[(gbs, q, tree)].replay()
            return self.outputs[(gbs, q, tree)][: bs * q]
