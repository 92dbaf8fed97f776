"""Prompts through the whole Engine, keeping the logits each step sampled from: what parity tests compare.

The engine's own scheduler, paging, runner and sampler produce the tokens, so a check against
transformers checks what users run. Row 0 of a run's logits is the prefill's (the prompt's last
position); row i > 0 is decode step i's, at the position of the i-th generated token.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine
from attnserve.engine.sampling_params import SamplingParams


@dataclass
class EngineRun:
    token_ids: list[int]
    finish_reason: str
    logits: torch.Tensor  # [len(token_ids), vocab] float32: what each generated token was sampled from


def record_logits(engine: Engine) -> dict[int, list[torch.Tensor]]:
    """Wrap the engine's runner so every step's logits rows are kept per request id (each row: [vocab])."""
    rows: dict[int, list[torch.Tensor]] = defaultdict(list)
    forward = engine.runner.forward

    def recording(batch):
        logits = forward(batch)  # [sampling requests, vocab], in batch order
        sampling = [r for r, s in zip(batch.reqs, batch.sample) if s]
        for r, row in zip(sampling, logits):
            rows[r.rid].append(row.float().cpu().clone())
        return logits

    engine.runner.forward = recording
    return rows


def run_engine(bundle, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams | None = None,
               **settings) -> list[EngineRun]:
    """Greedy (unless `params`) runs of every prompt, batched by the engine; settings: EngineConfig fields."""
    config = {"device": "cpu", "attention_backend": "torch_native", "max_total_tokens": 2048, **settings}
    engine = Engine(EngineConfig(**config), loaded=bundle)
    rows = record_logits(engine)
    params = params or SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    engine.run_until_done()
    assert engine.pages_leaked() == 0
    # with overlap scheduling a request that stops on EOS has run one more step, whose row is dropped
    return [EngineRun(r.output_ids, r.finish_reason.value, torch.stack(rows[r.rid][: len(r.output_ids)]))
            for r in reqs]


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())
