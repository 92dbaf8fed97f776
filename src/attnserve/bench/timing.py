"""Timing and the machine's ceilings, measured in the same run as the kernels they judge.

On a GPU: triton's do_bench or CUDA-graph replays, both with L2 cold before every call. On the CPU (`attnserve tune`
races torch_native against flex_attention there): torch.utils.benchmark's blocked autorange.
"""

from __future__ import annotations

import statistics

import torch

from attnserve.graph_capture import collector_paused_for_capture


def time_eager(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median microseconds per call with L2 cold before every call (triton.testing.do_bench).

    do_bench zeroes a 256 MB buffer before each timed call and times only the call between two
    events, so every call reads its inputs from HBM, as a layer's attention does in a model step."""
    from triton.testing import do_bench

    return 1000.0 * do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def flush_buffer(device: str = "cuda") -> torch.Tensor:
    """A buffer twice the L2 size (at least 64 MiB): zeroing it evicts whatever a call left in L2."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (128 << 20)
    return torch.empty(max(2 * l2, 64 << 20), dtype=torch.int8, device=device)  # [bytes]


def _capture(calls, calls_per_graph: int):
    graph = torch.cuda.CUDAGraph()
    with collector_paused_for_capture(), torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            for c in calls:
                c()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def _replay_us(graph, start, end) -> float:
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0


def time_graph(fn, calls_per_graph: int = 20, replays: int = 7, flush: bool = False) -> float:
    """Median microseconds per call with `calls_per_graph` calls captured in one CUDA graph.

    Decode kernels run tens of microseconds, where Python launch overhead would be
    timed instead of the kernel; a serving engine replays decode as a graph too.

    L2: with `flush` (what `time_call`, hence the kernel race and tune, asks for) the graph zeroes a flush buffer (`flush_buffer`) before every call,
    so each call starts with a cold L2 as in eager timing; a second graph holds the flushes alone, the
    two are replayed alternately, and the per-call time is the difference of their medians. Without it
    (the default, for sweeps that compare tiles of one kernel and MoE paths whose weights a model step
    reads warm) the calls of one replay follow each other warm, which flatters a workload whose KV fits
    in L2 (one 32k-token MLA request is 38 MB; the H200's L2 is 60 MB).
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    buf = flush_buffer() if flush else None
    clear = (lambda: buf.zero_()) if flush else None
    graph = _capture([clear, fn] if flush else [fn], calls_per_graph)
    flushes = _capture([clear], calls_per_graph) if flush else None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    both, alone = [], []
    for _ in range(replays):
        both.append(_replay_us(graph, start, end))
        if flushes is not None:
            alone.append(_replay_us(flushes, start, end))
    del graph, flushes
    overhead = statistics.median(alone) if alone else 0.0
    return max(statistics.median(both) - overhead, 0.0) / calls_per_graph


def time_cpu(fn, min_run_s: float = 0.2) -> float:
    """Median microseconds per call on the CPU (torch.utils.benchmark: blocks of calls until min_run_s)."""
    from torch.utils.benchmark import Timer

    return 1e6 * Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_s).median


def time_call(fn, use_graph: bool, device: str = "cuda") -> tuple[float, str]:
    """(microseconds, method): on a GPU a CUDA graph when asked and capturable, else eager, L2 cold before
    every call either way; on the CPU, eager."""
    if device == "cpu":
        return time_cpu(fn), "cpu"
    if use_graph:
        try:
            return time_graph(fn, flush=True), "cuda-graph (L2 flushed)"
        except Exception:  # noqa: BLE001 - some peers cannot be captured; time them eagerly rather than not at all
            torch.cuda.synchronize()
    return time_eager(fn), "eager"


def copy_bandwidth_tbps(bytes_each: int = 2 << 30, device: str = "cuda") -> float:
    """Device-to-device copy: read + write bytes over time, in TB/s."""
    src = torch.empty(bytes_each // 2, dtype=torch.bfloat16, device=device).normal_()  # [n]
    dst = torch.empty_like(src)
    us, _ = time_call(lambda: dst.copy_(src), use_graph=False, device=device)
    return 2 * bytes_each / us / 1e6


def matmul_tflops(n: int = 8192, device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> float:
    """n^3 matmul throughput in TFLOP/s (random data)."""
    a = torch.randn(n, n, dtype=dtype, device=device)  # [n, n]
    b = torch.randn(n, n, dtype=dtype, device=device)  # [n, n]
    us, _ = time_call(lambda: a @ b, use_graph=False, device=device)
    return 2 * n**3 / us / 1e6


def ceilings(device: str, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The roofline's two ceilings here: copy bandwidth and matmul throughput (the CPU gets smaller probes)."""
    small = device == "cpu"
    return {"copy_tbps": round(copy_bandwidth_tbps(64 << 20 if small else 2 << 30, device), 4),
            "matmul_tflops": round(matmul_tflops(1024 if small else 8192, device, dtype), 3)}
