"""Timing and the machine's ceilings, measured in the same run as the kernels they judge.

On a GPU: triton's do_bench (L2 flushed) or CUDA-graph replays. On the CPU (`attnserve tune`
races torch_native against flex_attention there): torch.utils.benchmark's blocked autorange.
"""

from __future__ import annotations

import statistics

import torch


def time_eager(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median microseconds per call, L2 flushed between calls (triton.testing.do_bench)."""
    from triton.testing import do_bench

    return 1000.0 * do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def time_graph(fn, calls_per_graph: int = 20, replays: int = 7) -> float:
    """Median microseconds per call with `calls_per_graph` calls captured in one CUDA graph.

    Decode kernels run tens of microseconds, where Python launch overhead would be
    timed instead of the kernel; a serving engine replays decode as a graph too.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / calls_per_graph)
    del graph
    return statistics.median(samples)


def time_cpu(fn, min_run_s: float = 0.2) -> float:
    """Median microseconds per call on the CPU (torch.utils.benchmark: blocks of calls until min_run_s)."""
    from torch.utils.benchmark import Timer

    return 1e6 * Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_s).median


def time_call(fn, use_graph: bool, device: str = "cuda") -> tuple[float, str]:
    """(microseconds, method): on a GPU a CUDA graph when asked and capturable, else eager; on the CPU, eager."""
    if device == "cpu":
        return time_cpu(fn), "cpu"
    if use_graph:
        try:
            return time_graph(fn), "cuda-graph"
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
