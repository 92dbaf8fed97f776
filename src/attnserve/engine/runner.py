"""ModelRunner: a ScheduleBatch -> a ForwardBatch -> logits for the requests that sample.

All per-step index arithmetic (slots, positions, the request->slot table rows
to write) is done on the host from the requests' page lists, then moved to the
device in a few copies from pinned memory, which never wait for the device;
the backend plans once per step, outside any graph. A decoding request's input
token is its last sampled one, which the runner keeps on the device
(`last_tokens`, one entry per request row): the host can build a decode step
before the previous step's tokens have reached it (overlap scheduling).
The runner reads requests and never writes them: how much of each table row is
written is the request->slot pool's bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attnserve.attention.base import AttentionBackend
from attnserve.attention.layer import attention_step
from attnserve.batch import ForwardBatch, ForwardMode
from attnserve.distributed.state import broadcast_object, broadcast_tensor, parallel_state
from attnserve.engine.cuda_graph import CudaGraphRunner
from attnserve.engine.piecewise_graph import PiecewiseGraphRunner
from attnserve.engine.scheduler import ScheduleBatch
from attnserve.engine.speculative.verify_inputs import verify_masks_of, verify_tokens
from attnserve.kvcache.pool import KVPool, ReqToTokenPool
from attnserve.transfers import to_device


@dataclass
class StepInputs:
    """One step as plain host data: all a tensor-parallel rank needs to run it without the scheduler's requests.

    host: [3T + B] int64, input ids (-1 for a decode whose token is still in flight: it is on the device, in
    last_tokens), positions and slots [T] each, then request rows [B]; seq_lens, extend_lens, sample: one per
    request; table_rows / table_starts / table_slots: the request->slot entries to write (row, first entry,
    slots) before the step.
    """

    mode: ForwardMode
    host: np.ndarray
    num_tokens: int
    num_decodes: int
    seq_lens: list[int]
    extend_lens: list[int]
    sample: list[bool]
    table_rows: list[int]
    table_starts: list[int]
    table_slots: list[np.ndarray]
    # K/V rows to copy (src slots, dst slots) before the step, on every rank: an accepted draft branch
    # compacted after the previous verify step. [2, N] int64 or None
    kv_moves: np.ndarray | None = None
    # TARGET_VERIFY with a tree: per request its [q, seq_len] mask flattened in batch order, and the
    # tree part alone [B, q, q] (what a verify graph takes); None for chains, which attend causally
    custom_mask: np.ndarray | None = None
    tree_mask: np.ndarray | None = None
    spec_topk: int = 0


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        backend: AttentionBackend,
        req_pool: ReqToTokenPool,
        device: str | torch.device,
        graph_runner: CudaGraphRunner | None = None,
        piecewise: PiecewiseGraphRunner | None = None,
    ):
        """`graph_runner`: captured decode (and verify) graphs to replay for the batch sizes it holds (None:
        always eager); `piecewise`: captured pieces of prompt-carrying steps up to its largest size (None: those
        run eagerly)."""
        self.model = model
        self.pool = pool
        self.backend = backend
        self.req_pool = req_pool
        self.device = torch.device(device)
        self.page_size = pool.page_size
        self.graph_runner = graph_runner
        self.piecewise = piecewise
        self.steps_graphed = 0
        self.steps_piecewise = 0  # prompt-carrying steps replayed in pieces (not counted as eager)
        self.steps_eager = 0
        rows = req_pool.req_to_token.shape[0]
        self.last_tokens = torch.zeros(rows, dtype=torch.int64, device=self.device)  # [rows]: latest token per row
        self._kv_moves: list[np.ndarray] = []  # [2, n] each: copies the next step makes first

    @classmethod
    def from_parts(cls, parts) -> ModelRunner:
        """The runner over what start-up built (`startup.EngineParts`)."""
        return cls(parts.model.module, parts.kv.pool, parts.backend, parts.kv.req_pool, parts.model.device,
                   graph_runner=parts.graphs.runner, piecewise=parts.graphs.piecewise)

    def _slots(self, pages: list[int], lo: int, hi: int) -> np.ndarray:
        """Slots of token positions [lo, hi) of a request holding `pages`: [hi - lo] int64."""
        ps = self.page_size
        if hi - lo == 1:
            return np.array([pages[lo // ps] * ps + lo % ps], dtype=np.int64)
        pos = np.arange(lo, hi, dtype=np.int64)
        first = lo // ps
        page_arr = np.asarray(pages[first : (hi - 1) // ps + 1], dtype=np.int64)
        return page_arr[pos // ps - first] * ps + pos % ps

    def forward(self, batch: ScheduleBatch) -> torch.Tensor:
        """Run one step; returns logits `[num sampling requests, vocab]` (float32) in batch order.

        Launches the work and returns without waiting for the device: nothing here reads device memory.
        Under tensor parallelism (rank 0 of a world) the step's host inputs go to every other rank first,
        and every rank runs the same `run`.
        """
        with torch.inference_mode():  # plan and graph buffers, too, are made and updated in inference mode
            step = self.prepare(batch)
            if parallel_state().active:
                broadcast_object(step)
            return self._run(step)

    def record_sampled(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Remember each sampling request's new token on the device (`rows` [S], `tokens` [S] int64): its
        next decode step reads it there, so the host need not know it before scheduling that step. Under
        tensor parallelism rank 0's tokens reach every rank's `last_tokens` (a device broadcast, no host sync)."""
        self.last_tokens.index_copy_(0, rows, broadcast_tensor(tokens))

    def slot_of(self, pages: list[int], pos: int) -> int:
        ps = self.page_size
        return pages[pos // ps] * ps + pos % ps

    def defer_kv_move(self, src: list[int], dst: list[int]) -> None:
        """Copy K/V from slots `src` to `dst` (every layer) at the start of the next step, on every rank.
        Nothing reads the pool between steps, so the copy is in place before anything needs it."""
        if src:
            self._kv_moves.append(np.array([src, dst], dtype=np.int64))

    def _take_kv_moves(self) -> np.ndarray | None:
        if not self._kv_moves:
            return None
        moves, self._kv_moves = np.concatenate(self._kv_moves, axis=1), []
        return moves

    def prepare(self, batch: ScheduleBatch) -> StepInputs:
        """The step's index arithmetic on the host, from the requests' page lists. A verify step's inputs are
        each request's last token then its drafts (`speculative.verify_inputs`)."""
        verify = batch.mode is ForwardMode.TARGET_VERIFY
        num_tokens = batch.num_tokens
        bs = batch.batch_size
        # one int64 host array, one copy to the device: input ids, positions, slots [T] each; rows [B]
        host = np.empty(3 * num_tokens + bs, dtype=np.int64)
        ids, positions, out_loc = (host[i * num_tokens : (i + 1) * num_tokens] for i in range(3))
        host[3 * num_tokens :] = [r.row for r in batch.reqs]
        table_rows, table_starts, table_slots = [], [], []
        t = 0
        for i, (r, prefix, ext) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens)):
            end = prefix + ext
            # below prefix when a cached prefix was just matched; above it after a verify step whose
            # drafts were rejected (their entries are rewritten)
            filled = min(self.req_pool.filled(r.row), prefix)
            slots = self._slots(r.pages, filled, end)  # [end - filled]
            table_rows.append(r.row)
            table_starts.append(filled)
            table_slots.append(slots)
            out_loc[t : t + ext] = slots[prefix - filled :]
            if verify:
                ids[t : t + ext], positions[t : t + ext] = verify_tokens(r.output_ids[-1], prefix, batch.drafts[i])
            elif i < batch.num_decodes:
                # one token, the request's last: known here unless it is still in flight, and then it is in
                # last_tokens on the device (-1: read it there). A request readmitted after a preemption has a
                # known last token that was never sampled into its new row.
                ids[t] = r.output_ids[-1] if r.num_pending == 0 else -1
                positions[t] = prefix
            else:
                ids[t : t + ext] = r.tokens(prefix, end)
                positions[t : t + ext] = np.arange(prefix, end, dtype=np.int64)
            t += ext
        step = StepInputs(
            mode=batch.mode, host=host, num_tokens=num_tokens, num_decodes=0 if verify else batch.num_decodes,
            seq_lens=[p + e for p, e in zip(batch.prefix_lens, batch.extend_lens)],
            extend_lens=list(batch.extend_lens),
            # a verify step sends nothing to last_tokens: the engine reads the accepted tokens on the host
            sample=[False] * bs if verify else list(batch.sample),
            table_rows=table_rows, table_starts=table_starts, table_slots=table_slots,
            kv_moves=self._take_kv_moves(),
        )
        if verify:
            masks = verify_masks_of(batch.drafts, batch.prefix_lens)
            step.custom_mask, step.tree_mask, step.spec_topk = masks.custom_mask, masks.tree_mask, masks.spec_topk
        return step

    def run(self, step: StepInputs) -> torch.Tensor:
        """Write the table rows, move the inputs to the device, and run the model (replaying a graph if one fits)."""
        with torch.inference_mode():
            return self._run(step)

    def _run(self, step: StepInputs) -> torch.Tensor:
        dev = self.device
        num_tokens = step.num_tokens
        if step.kv_moves is not None:
            moves = to_device(step.kv_moves, dev)  # [2, N]
            self.pool.copy_slots(moves[0], moves[1])
        # write the new tokens' slots (and a newly admitted request's cached prefix) into its row
        self.req_pool.write_at(step.table_rows, step.table_starts, step.table_slots)

        seq_lens_cpu = step.seq_lens
        packed = to_device(step.host, dev)  # [3T + B]
        input_ids, pos, loc = (packed[i * num_tokens : (i + 1) * num_tokens] for i in range(3))  # [T] each
        req_rows = packed[3 * num_tokens :]  # [B]
        nd = step.num_decodes
        if nd:  # decodes come first, one token each: their input rows are 0..nd-1
            known = input_ids[:nd]
            input_ids[:nd] = torch.where(known < 0, self.last_tokens[req_rows[:nd]], known)
        seq_lens = to_device(np.asarray(seq_lens_cpu, dtype=np.int32), dev)  # [B]
        verify = step.mode is ForwardMode.TARGET_VERIFY
        width = self._graph_width(step)
        if width is not None:
            self.steps_graphed += 1
            tree_mask = to_device(step.tree_mask, dev) if step.custom_mask is not None else None  # [B, q, q] bool
            logits = self.graph_runner.replay(input_ids, pos, loc, req_rows, seq_lens, seq_lens_cpu, width, tree_mask)
            if verify or all(step.sample):
                return logits
            return logits[to_device([i for i, s in enumerate(step.sample) if s], dev)]

        fb = self._eager_batch(step, pos, loc, req_rows, seq_lens)
        meta = self.backend.plan(fb)
        logits_indices = None
        if not verify:  # a verify step needs every token's logits; others only the sampling requests' last
            last = np.cumsum(step.extend_lens) - 1  # row of each request's last new token
            picked = [int(t) for t, s in zip(last, step.sample) if s]
            logits_indices = None if len(picked) == num_tokens else to_device(picked, dev)
        pw = self.piecewise
        if pw is not None and step.mode in (ForwardMode.EXTEND, ForwardMode.MIXED) and pw.can_run(num_tokens):
            self.steps_piecewise += 1
            hidden, residual = pw.replay(input_ids, pos, fb, meta)  # [T, hidden] each
            return self.model.compute_logits(hidden, logits_indices, residual)
        self.steps_eager += 1
        with attention_step(self.backend, meta):
            return self.model(input_ids, pos, fb, logits_indices=logits_indices)

    def _graph_width(self, step: StepInputs) -> int | None:
        """The tokens a request of a captured graph that runs this step: 1 for decode, q for a verify step whose
        requests all run q tokens (a tree's compact mask known); None: the step runs eagerly."""
        gr = self.graph_runner
        if gr is None or step.mode not in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            return None
        bs, q = len(step.seq_lens), step.extend_lens[0]
        tree = step.custom_mask is not None
        if step.mode is ForwardMode.TARGET_VERIFY and (any(e != q for e in step.extend_lens)
                                                       or (tree and step.tree_mask is None)):
            return None
        return q if gr.can_run(bs, q, tree) else None

    def _eager_batch(self, step: StepInputs, pos, loc, req_rows, seq_lens) -> ForwardBatch:
        """The step's ForwardBatch over the device inputs (a tree verify step carries its mask)."""
        dev = self.device
        return ForwardBatch(
            mode=step.mode,
            req_pool_indices=req_rows,
            seq_lens=seq_lens,
            extend_lens=to_device(np.asarray(step.extend_lens, dtype=np.int32), dev),
            positions=pos,
            out_cache_loc=loc,
            req_to_token=self.req_pool.req_to_token,
            pool=self.pool,
            seq_lens_cpu=step.seq_lens,
            extend_lens_cpu=list(step.extend_lens),
            custom_mask=to_device(step.custom_mask, dev) if step.custom_mask is not None else None,
            spec_topk=step.spec_topk,
        )
