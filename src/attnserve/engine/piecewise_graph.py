"""Piecewise CUDA graphs for steps that carry prompt tokens: everything but attention replayed from graphs.

A decode step replays one graph of the whole model (`cuda_graph.py`); a step with prompt tokens (EXTEND or
MIXED) cannot, because its attention depends on the step's lengths. Run eagerly, a 32-layer model then
launches a few hundred kernels from Python, and below about a thousand tokens the GPU waits on the host. Here
each step size T (a bucket) is captured as the pieces between attention calls, as vLLM and SGLang split the
model: piece 0 runs from the embeddings to layer 0's q/k/v, piece i from layer i-1's attention output to layer
i's q/k/v, the last one to the final hidden states. A replay copies the step's ids and positions in (padded to
the bucket), replays piece 0, runs layer 0's attention eagerly over the step's real tokens with the backend's
plan for the step, replays piece 1, and so on; the final norm and LM head then run eagerly on the rows that
sample.

q/k/v and the attention output cross between pieces through fixed buffers shared by every layer and bucket
(each piece copies its layer's q/k/v in, the next reads the output), so a bucket keeps no per-layer
activations. The step's RoPE tables, made by piece 0, stay with the bucket. Padded rows have position 0 and
token 0; attention never sees them, and their rows of the output hold whatever an earlier step left there.
Models whose layers branch on the step's plan (MLA's expanded prefill) cannot be cut: see `model_can_be_cut`.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from attnserve.attention.base import AttentionBackend
from attnserve.attention.layer import AttentionLayer, attention_cut, attention_step
from attnserve.batch import ForwardBatch, ForwardMode
from attnserve.graph_capture import collector_paused_for_capture
from attnserve.kvcache.pool import KVPool, ReqToTokenPool

log = logging.getLogger("attnserve.engine")


def default_token_sizes(max_tokens: int) -> list[int]:
    """Every 64 tokens up to 512, every 128 up to 1024, every 256 beyond (padding wastes at most 1/8 past 512);
    capped at max_tokens, which is always one."""
    if max_tokens < 1:
        raise ValueError(f"piecewise graph max tokens must be >= 1, got {max_tokens}")
    sizes = list(range(64, 513, 64)) + list(range(640, 1025, 128)) + list(range(1280, 65537, 256))
    out = [s for s in sizes if s < max_tokens]
    return out + [max_tokens]


def model_can_be_cut(model: torch.nn.Module) -> str | None:
    """Why `model`'s forward cannot be captured in pieces (None: it can)."""
    layers = [m for m in model.modules() if isinstance(m, AttentionLayer)]
    if not layers:
        return "the model has no attention layers to cut at"
    if any(layer.is_mla for layer in layers):
        return "MLA layers choose their prefill path from the step's plan"
    if not hasattr(model, "forward_hidden"):
        return "the model has no forward_hidden"
    return None


@dataclass
class Cut:
    """Where one piece ends: the layer whose attention runs between it and the next, and what that call
    received besides q/k/v."""

    layer: AttentionLayer
    save_kv: bool
    rope: object | None  # the step's RopeStep, made by piece 0 for the whole bucket
    has_k: bool
    has_v: bool


@dataclass
class Bucket:
    tokens: int
    pieces: list  # len(cuts) + 1 graphs
    cuts: list[Cut]
    hidden: torch.Tensor  # [tokens, hidden]: the last piece's output
    residual: torch.Tensor | None  # [tokens, hidden]


class CrossingBuffers:
    """q, k, v and the attention output of one layer at a time, `[max_tokens, width]` each (flat storage viewed
    at the width of each call), allocated once outside any capture."""

    def __init__(self, max_tokens: int, widths: dict[str, int], dtype: torch.dtype, device):
        self.max_tokens = max_tokens
        self.flat = {name: torch.zeros(max_tokens * w, dtype=dtype, device=device) for name, w in widths.items()}

    def view(self, name: str, tokens: int, *shape: int) -> torch.Tensor:
        """`[tokens, *shape]` at the start of buffer `name`."""
        n = tokens
        for s in shape:
            n *= s
        return self.flat[name][:n].view(tokens, *shape)


class PiecewiseGraphRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, pool: KVPool, req_pool: ReqToTokenPool,
                 padding_row: int, token_sizes: list[int], device: torch.device, dtype: torch.dtype):
        why = model_can_be_cut(model)
        if why is not None:
            raise ValueError(f"piecewise CUDA graphs: {why}")
        self.model = model
        self.backend = backend
        self.pool = pool
        self.req_pool = req_pool
        self.padding_row = padding_row
        self.token_sizes = sorted(set(token_sizes))
        self.max_tokens = self.token_sizes[-1]
        self.device = device
        self.input_ids = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)  # [max_tokens]
        self.positions = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)  # [max_tokens]
        layers = [m for m in model.modules() if isinstance(m, AttentionLayer)]
        widths = {
            "q": max(layer.num_heads * layer.head_dim for layer in layers),
            "k": max(layer.num_kv_heads * layer.head_dim for layer in layers),
            "v": max(layer.num_kv_heads * layer.v_head_dim for layer in layers),
            "o": max(layer.num_heads * layer.v_head_dim for layer in layers),
        }
        self.crossing = CrossingBuffers(self.max_tokens, widths, dtype, device)
        self.buckets: dict[int, Bucket] = {}
        self.capture_seconds = 0.0
        self._mempool = None
        self._stream: torch.cuda.Stream | None = None

    # ---- the cut: what a layer does at a piece's end --------------------------------------------------------
    def _hand_over(self, layer: AttentionLayer, q, k, v) -> None:
        """Copy a layer's q/k/v into the crossing buffers (inside the piece that made them)."""
        tokens = q.shape[0]
        self.crossing.view("q", tokens, layer.num_heads, layer.head_dim).copy_(
            q.view(tokens, layer.num_heads, layer.head_dim))
        if k is not None:
            self.crossing.view("k", tokens, layer.num_kv_heads, layer.head_dim).copy_(
                k.view(tokens, layer.num_kv_heads, layer.head_dim))
        if v is not None:
            self.crossing.view("v", tokens, layer.num_kv_heads, layer.v_head_dim).copy_(
                v.view(tokens, layer.num_kv_heads, layer.v_head_dim))

    def _output(self, layer: AttentionLayer, tokens: int) -> torch.Tensor:
        return self.crossing.view("o", tokens, layer.num_heads * layer.v_head_dim)  # [tokens, H * v_head_dim]

    def _attend(self, cut: Cut, tokens: int, fb: ForwardBatch) -> None:
        """The eager part between two pieces: `cut`'s layer attends over the step's `tokens` real tokens, from
        the crossing buffers into the output buffer."""
        layer = cut.layer
        q = self.crossing.view("q", tokens, layer.num_heads, layer.head_dim)
        k = self.crossing.view("k", tokens, layer.num_kv_heads, layer.head_dim) if cut.has_k else None
        v = self.crossing.view("v", tokens, layer.num_kv_heads, layer.v_head_dim) if cut.has_v else None
        rope = cut.rope.narrow(tokens) if cut.rope is not None else None
        o = layer(q, k, v, fb, save_kv=cut.save_kv, rope=rope)  # [tokens, H * v_head_dim]
        self._output(layer, tokens).copy_(o)

    # ---- capture -----------------------------------------------------------------------------------------
    def _capture_batch(self, tokens: int) -> ForwardBatch:
        """What the model sees while a bucket is captured: a prompt step of `tokens` tokens on the padding row
        (no layer attends then, so only the mode matters)."""
        dev = self.device
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            req_pool_indices=torch.full((1,), self.padding_row, dtype=torch.int64, device=dev),
            seq_lens=torch.full((1,), tokens, dtype=torch.int32, device=dev),
            extend_lens=torch.full((1,), tokens, dtype=torch.int32, device=dev),
            positions=self.positions[:tokens],
            out_cache_loc=torch.zeros(tokens, dtype=torch.int64, device=dev),
            req_to_token=self.req_pool.req_to_token,
            pool=self.pool,
            seq_lens_cpu=[tokens],
            extend_lens_cpu=[tokens],
        )

    def _new_graph(self):
        return torch.cuda.CUDAGraph()

    def _record(self, tokens: int) -> Bucket:
        """Warm the pieces up outside capture, then capture them one after another on a side stream."""
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(device=self.device)
        fb = self._capture_batch(tokens)
        ids, pos = self.input_ids[:tokens], self.positions[:tokens]

        def warm_cut(layer, q, k, v, fb_, save_kv, rope):
            self._hand_over(layer, q, k, v)
            return self._output(layer, tokens)

        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), attention_cut(warm_cut):
            for _ in range(2):  # autotuning and lazy init happen outside capture
                self.model.forward_hidden(ids, pos, fb)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

        pieces, cuts = [self._new_graph()], []

        def capture_cut(layer, q, k, v, fb_, save_kv, rope):
            self._hand_over(layer, q, k, v)
            pieces[-1].capture_end()
            cuts.append(Cut(layer, save_kv, rope, k is not None, v is not None))
            pieces.append(self._new_graph())
            pieces[-1].capture_begin(pool=self._mempool)
            return self._output(layer, tokens)

        with torch.cuda.stream(stream), attention_cut(capture_cut):
            pieces[0].capture_begin(pool=self._mempool)
            hidden, residual = self.model.forward_hidden(ids, pos, fb)
            pieces[-1].capture_end()
        torch.cuda.synchronize(self.device)
        return Bucket(tokens, pieces, cuts, hidden, residual)

    def capture(self) -> float:
        """Capture every bucket, largest first (smaller ones reuse its memory pool)."""
        start = time.perf_counter()
        with torch.inference_mode(), collector_paused_for_capture():
            for tokens in reversed(self.token_sizes):
                self.buckets[tokens] = self._record(tokens)
        self.capture_seconds = time.perf_counter() - start
        return self.capture_seconds

    # ---- replay ------------------------------------------------------------------------------------------
    def can_run(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_tokens and bool(self.buckets)

    def bucket_for(self, num_tokens: int) -> int:
        return self.token_sizes[bisect.bisect_left(self.token_sizes, num_tokens)]

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch,
               meta) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's (hidden, residual) `[T, hidden]` for a step of T = len(input_ids) tokens: the pieces of
        the next bucket replayed, each layer attending eagerly on `self.backend` over `meta` (its plan for fb)."""
        tokens = input_ids.shape[0]
        bucket = self.buckets[self.bucket_for(tokens)]
        self.input_ids[:tokens].copy_(input_ids)
        self.positions[:tokens].copy_(positions)
        if bucket.tokens > tokens:
            self.input_ids[tokens : bucket.tokens].zero_()
            self.positions[tokens : bucket.tokens].zero_()
        with attention_step(self.backend, meta):
            hidden, residual = self._run_pieces(bucket, tokens, fb)
        return hidden[:tokens], residual[:tokens] if residual is not None else None

    def _run_pieces(self, bucket: Bucket, tokens: int, fb: ForwardBatch):
        """Replay the bucket's pieces with each layer's attention between them: (hidden, residual) of the
        whole bucket."""
        for piece, cut in zip(bucket.pieces, bucket.cuts):
            piece.replay()
            self._attend(cut, tokens, fb)
        bucket.pieces[-1].replay()
        return bucket.hidden, bucket.residual
