"""Host time per decode step at 64 and 256 running requests, with the model's compute taken out.

On a GPU the host work of a step (schedule, build the step's index tensors and the
ForwardBatch, plan the attention backend, sample, finish requests) is time the GPU waits
unless it overlaps the previous step. This measures that work alone on the CPU: the engine
runs a tiny model whose forward is replaced by a stub returning random logits, so every
millisecond reported is host bookkeeping. Phases:

  schedule   Scheduler.schedule (decode page growth, prefill admission)
  metadata   ModelRunner.forward minus plan and the stub model (slots, positions, req_to_token
             writes, ForwardBatch)
  plan       backend.plan (CSR metadata, split-KV plan) for --backend
  rest       the remainder of Engine.step: commit, sampling, appending tokens, stop checks

On the CPU (--device cpu) the metadata and plan phases also do their tensor arithmetic
(O(context tokens) gathers, prefix sums) synchronously, which a GPU runs as asynchronous
kernels, so there they are an upper bound on host time. --device cuda measures the
real thing (eager steps, since the stub is not captured in a graph; the sampler's
device->host copy of the tokens is where the host waits for the GPU, inside `rest`).

    PYTHONPATH=src python3 benchmarks/engine_host_cost.py --out benchmarks/results/engine_host_cost.json

Issue 11's target: schedule + metadata + plan under 1 ms at 64 and under 2 ms at 256 requests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the tiny model of the tests


class StubModel(torch.nn.Module):
    """Stands in for the model: logits of the right shape, no compute (host cost only)."""

    def __init__(self, model: torch.nn.Module, vocab: int):
        super().__init__()
        self.inner, self.vocab = model, vocab
        self.seconds = 0.0

    def kv_cache_spec(self):
        return self.inner.kv_cache_spec()

    def forward(self, input_ids, positions, fb, logits_indices=None):
        t = time.perf_counter()
        rows = input_ids.numel() if logits_indices is None else logits_indices.numel()
        out = torch.rand(rows, self.vocab, device=input_ids.device)  # [rows, vocab]
        self.seconds += time.perf_counter() - t
        return out


def _timed(fn, acc: dict, key: str):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - t

    return wrapper


def measure(running: int, input_len: int, steps: int, backend: str, page_size: int, device: str) -> dict:
    from engine_helpers import TinyBundle, tiny_llama

    from attnserve.engine.config import EngineConfig
    from attnserve.engine.engine import Engine
    from attnserve.engine.sampling_params import SamplingParams

    tiny = tiny_llama()
    vocab = tiny.model.config.vocab_size
    stub = StubModel(tiny.model.to(device), vocab)
    on_cpu_triton = device == "cpu" and backend == "triton"
    engine = Engine(EngineConfig(device=device, attention_backend="torch_native" if on_cpu_triton else backend,
                                 page_size=page_size, max_running_requests=running, chunked_prefill_size=None,
                                 disable_cuda_graph=True, dtype="fp32",
                                 max_total_tokens=running * (input_len + steps + 64) + 1024,
                                 max_context_len=input_len + steps + 64, max_prefill_tokens=input_len * running),
                    loaded=TinyBundle(stub))
    if on_cpu_triton:  # selection refuses triton on the CPU; its plan is host work and runs on CPU tensors too
        from attnserve.attention.backends.triton import TritonBackend

        engine.runner.backend = TritonBackend(engine.parts.kv.pool)
    g = torch.Generator().manual_seed(1)
    for _ in range(running):
        engine.add_request(torch.randint(0, vocab, (input_len,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=steps + 32, ignore_eos=True))
    while len(engine.scheduler.running) < running or engine.scheduler.waiting or any(
            r.is_prefilling for r in engine.scheduler.running):
        engine.step()
    acc: dict[str, float] = {}
    sched, runner = engine.scheduler, engine.runner
    sched.schedule = _timed(sched.schedule, acc, "schedule")
    runner.forward = _timed(runner.forward, acc, "forward")
    runner.backend.plan = _timed(runner.backend.plan, acc, "plan")
    per_step: dict[str, list[float]] = {
        k: [] for k in ("schedule", "metadata", "plan", "rest", "schedule_metadata_plan", "step")}
    for _ in range(steps):
        acc.clear()
        stub.seconds = 0.0
        t = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t
        meta = acc["forward"] - acc["plan"] - stub.seconds
        per_step["schedule"].append(acc["schedule"])
        per_step["metadata"].append(meta)
        per_step["plan"].append(acc["plan"])
        per_step["rest"].append(total - acc["schedule"] - acc["forward"])
        per_step["schedule_metadata_plan"].append(acc["schedule"] + meta + acc["plan"])
        per_step["step"].append(total - stub.seconds)
    ms = {k: round(statistics.median(v) * 1e3, 3) for k, v in per_step.items()}  # each the median of its own
    # on a shared machine the scheduler's time slices land in random phases: min shows the work itself
    ms_min = {k: round(min(v) * 1e3, 3) for k, v in per_step.items()}
    return {"running_requests": running, "context_tokens": input_len, "backend": backend,
            "page_size": page_size, "device": device, "median_ms": ms, "min_ms": ms_min, "decode_steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", default="64,256")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--backends", default="triton,torch_native")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default="benchmarks/results/engine_host_cost.json")
    args = ap.parse_args()
    if args.device == "cpu":  # the triton backend takes a CPU pool only under the interpreter (set before import)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)  # host bookkeeping is single-threaded; keep the stub's rand out of the way
    results = []
    for backend in args.backends.split(","):
        for n in map(int, args.running.split(",")):
            r = measure(n, args.input_len, args.steps, backend, args.page_size, args.device)
            print(json.dumps(r), flush=True)
            results.append(r)
    report = {
        "what": "host time per decode step (model compute stubbed out), median and min over steps, ms",
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "targets_ms": {"64": 1.0, "256": 2.0},
        "results": results,
        "command": "PYTHONPATH=src python3 benchmarks/engine_host_cost.py",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
