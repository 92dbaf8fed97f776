"""Running requests under deterministic inference and saying which CPU kernels a run was on.

`conditions` goes into every assertion message of the determinism tests: a failure on one machine and a
pass on another are then told apart by the kernel path (the weights note of the start-up log: oneDNN bf16,
BLAS fp32, int4, and the rows per call) and by whether the CPU has AMX / AVX512-BF16 and how many threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine
from attnserve.engine.sampling_params import SamplingParams


def cpu_bf16() -> str:
    """How this CPU multiplies bf16: 'amx', 'avx512bf16' or 'nobf16' (oneDNN picks its kernels by it)."""
    try:
        words = set(Path("/proc/cpuinfo").read_text().split("\n\nprocessor", 1)[0].split())
    except OSError:
        return "nobf16"
    if "amx_bf16" in words:
        return "amx"
    return "avx512bf16" if "avx512_bf16" in words else "nobf16"


def conditions(engine: Engine) -> str:
    """The kernel path an engine's steps ran on, for assertion messages."""
    return (f"weights: {engine.parts.model.weights_note}; dtype {str(engine.parts.model.dtype).replace('torch.', '')};"
            f" cpu bf16: {cpu_bf16()}; torch threads: {torch.get_num_threads()}")


@dataclass
class Work:
    prompt: list[int]
    params: SamplingParams
    arrival: int = 0  # engine step before which it is added
    abort_at: int | None = None  # engine step before which it is aborted (None: runs to the end)


@dataclass
class Run:
    logits: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # work index -> logits row per sampled step
    tokens: dict[int, list[int]] = field(default_factory=dict)
    preempted: dict[int, int] = field(default_factory=dict)
    engine: Engine | None = None


def run(bundle, settings: dict, work: list[Work]) -> Run:
    """Each work item added (and aborted) at its step in one fresh engine; the logits each got, bit for bit."""
    engine = Engine(EngineConfig(**settings), loaded=bundle)
    seen: dict[int, list[torch.Tensor]] = {}
    forward = engine.runner.forward

    def spy(batch):
        logits = forward(batch)
        sampling = [r for r, s in zip(batch.reqs, batch.sample) if s]
        for i, r in enumerate(sampling):
            seen.setdefault(r.rid, []).append(logits[i].clone())
        return logits

    engine.runner.forward = spy
    reqs = {}
    step = 0
    while step <= max(max(w.arrival for w in work), max((w.abort_at or 0) for w in work)) or engine.has_work():
        for j, w in enumerate(work):
            if w.arrival == step:
                reqs[j] = engine.add_request(w.prompt, w.params)
            if w.abort_at == step and j in reqs:
                engine.abort(reqs[j].rid)
        engine.step()
        step += 1
    assert engine.pages_leaked() == 0
    out = Run(engine=engine)
    for j, r in reqs.items():
        out.logits[j] = seen.get(r.rid, [])
        out.tokens[j] = list(r.output_ids)
        out.preempted[j] = r.num_preemptions
    return out


def assert_each_as_alone(bundle, settings: dict, work: list[Work]) -> Run:
    """Every request that was not aborted got, at every step, the logits (bitwise) and tokens it gets alone in a
    fresh engine. Returns the mixed run."""
    mixed = run(bundle, settings, work)
    why = conditions(mixed.engine)
    for j, w in enumerate(work):
        if w.abort_at is not None:
            continue
        alone = run(bundle, settings, [Work(w.prompt, w.params)])
        kind = "greedy" if w.params.greedy else f"seeded (seed {w.params.seed})"
        n = len(alone.tokens[0])
        assert len(alone.logits[0]) >= n and len(mixed.logits[j]) >= len(mixed.tokens[j]) > 0
        for step, (a, b) in enumerate(zip(alone.logits[0][:n], mixed.logits[j])):
            assert torch.equal(a, b), (
                f"request {j} ({kind}, prompt of {len(w.prompt)}, arrived at step {w.arrival}, preempted "
                f"{mixed.preempted[j]}x): logits of its token {step} differ from its run alone by up to "
                f"{(a.float() - b.float()).abs().max().item():.3g} [{why}]")
        assert mixed.tokens[j] == alone.tokens[0], f"request {j} ({kind}): tokens differ from its run alone [{why}]"
    return mixed
