"""ModelRunner: a ScheduleBatch -> a ForwardBatch -> logits for the requests that sample.

All per-step index arithmetic (slots, positions, the request->slot table rows
to write) is done on the host from the requests' page lists, then moved to the
device in a few copies; the backend plans once per step, outside any graph.
The runner reads requests and never writes them: how much of each table row is
written is the request->slot pool's bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attnserve.attention.base import AttentionBackend, ForwardBatch, ForwardMode
from attnserve.distributed.state import broadcast_object, parallel_state
from attnserve.engine.cuda_graph import CudaGraphRunner
from attnserve.engine.scheduler import ScheduleBatch
from attnserve.kvcache.pool import KVPool, ReqToTokenPool


@dataclass
class StepInputs:
    """One step as plain host data: all a tensor-parallel rank needs to run it without the scheduler's requests.

    input_ids, positions, out_cache_loc: [T] int64; req_rows, seq_lens, extend_lens, sample: one per request;
    table_rows / table_starts / table_slots: the request->slot entries to write (row, first entry, slots) before
    the step.
    """

    mode: ForwardMode
    input_ids: np.ndarray
    positions: np.ndarray
    out_cache_loc: np.ndarray
    req_rows: list[int]
    seq_lens: list[int]
    extend_lens: list[int]
    sample: list[bool]
    table_rows: list[int]
    table_starts: list[int]
    table_slots: list[np.ndarray]


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        backend: AttentionBackend,
        req_pool: ReqToTokenPool,
        device: str | torch.device,
        graph_runner: CudaGraphRunner | None = None,
    ):
        """`graph_runner`: captured decode graphs to replay for the batch sizes it holds (None: always eager)."""
        self.model = model
        self.pool = pool
        self.backend = backend
        self.req_pool = req_pool
        self.device = torch.device(device)
        self.page_size = pool.page_size
        self.graph_runner = graph_runner
        self.steps_graphed = 0
        self.steps_eager = 0

    @classmethod
    def from_parts(cls, parts) -> ModelRunner:
        """The runner over what start-up built (`setup.EngineParts`)."""
        return cls(parts.model.module, parts.kv.pool, parts.backend, parts.kv.req_pool, parts.model.device,
                   graph_runner=parts.graphs.runner)

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

        Under tensor parallelism (rank 0 of several) the step's host-side inputs go to every other rank
        first, and every rank runs the same `run`."""
        with torch.inference_mode():  # plan and graph buffers, too, are made and updated in inference mode
            step = self.prepare(batch)
            if parallel_state().active:
                broadcast_object(step)
            return self.run(step)

    def prepare(self, batch: ScheduleBatch) -> StepInputs:
        """The step's index arithmetic on the host, from the requests' page lists."""
        ids, positions, out_loc = [], [], []
        table_rows, table_starts, table_slots = [], [], []
        for r, prefix, ext in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            end = prefix + ext
            filled = self.req_pool.filled(r.row)  # below prefix only when a cached prefix was just matched
            slots = self._slots(r.pages, filled, end)  # [end - filled]
            table_rows.append(r.row)
            table_starts.append(filled)
            table_slots.append(slots)
            out_loc.append(slots[prefix - filled :])
            ids.append(np.asarray(r.tokens(prefix, end), dtype=np.int64))
            positions.append(np.arange(prefix, end, dtype=np.int64))
        return StepInputs(
            mode=batch.mode, input_ids=np.concatenate(ids), positions=np.concatenate(positions),
            out_cache_loc=np.concatenate(out_loc), req_rows=[r.row for r in batch.reqs],
            seq_lens=[p + e for p, e in zip(batch.prefix_lens, batch.extend_lens)],
            extend_lens=list(batch.extend_lens), sample=list(batch.sample),
            table_rows=table_rows, table_starts=table_starts, table_slots=table_slots,
        )

    def run(self, step: StepInputs) -> torch.Tensor:
        """Write the table rows, move the inputs to the device, and run the model (replaying a graph if one fits)."""
        with torch.inference_mode():
            return self._run(step)

    def _run(self, step: StepInputs) -> torch.Tensor:
        dev = self.device
        # write the new tokens' slots (and a newly admitted request's cached prefix) into its row
        self.req_pool.write_at(step.table_rows, step.table_starts, step.table_slots)

        seq_lens_cpu = step.seq_lens
        input_ids = torch.from_numpy(step.input_ids).to(dev)  # [T]
        pos = torch.from_numpy(step.positions).to(dev)  # [T]
        loc = torch.from_numpy(step.out_cache_loc).to(dev)  # [T]
        req_rows = torch.tensor(step.req_rows, dtype=torch.int64, device=dev)  # [B]
        seq_lens = torch.tensor(seq_lens_cpu, dtype=torch.int32, device=dev)  # [B]
        batch_size = len(step.req_rows)

        if (
            self.graph_runner is not None
            and step.mode is ForwardMode.DECODE
            and self.graph_runner.can_run(batch_size)
        ):
            self.steps_graphed += 1
            logits = self.graph_runner.replay(input_ids, pos, loc, req_rows, seq_lens, seq_lens_cpu)
            return logits[torch.tensor([i for i, s in enumerate(step.sample) if s], device=dev)] \
                if not all(step.sample) else logits

        self.steps_eager += 1
        fb = ForwardBatch(
            mode=step.mode,
            req_pool_indices=req_rows,
            seq_lens=seq_lens,
            extend_lens=torch.tensor(step.extend_lens, dtype=torch.int32, device=dev),
            positions=pos,
            out_cache_loc=loc,
            req_to_token=self.req_pool.req_to_token,
            pool=self.pool,
            attn_backend=self.backend,
            seq_lens_cpu=seq_lens_cpu,
            extend_lens_cpu=list(step.extend_lens),
        )
        self.backend.plan(fb)
        last = np.cumsum(step.extend_lens) - 1  # row of each request's last new token
        picked = [int(t) for t, s in zip(last, step.sample) if s]
        logits_indices = None if len(picked) == input_ids.numel() else torch.tensor(picked, dtype=torch.int64, device=dev)
        return self.model(input_ids, pos, fb, logits_indices=logits_indices)
