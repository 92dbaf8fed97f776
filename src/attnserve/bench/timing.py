"""GPU timing and the machine's ceilings, measured in the same run as the kernels they judge."""

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


def time_call(fn, use_graph: bool) -> tuple[float, str]:
    """(microseconds, method): a CUDA graph when asked and capturable, else eager."""
    if use_graph:
        try:
            return time_graph(fn), "cuda-graph"
        except Exception:  # noqa: BLE001 - some peers cannot be captured; time them eagerly rather than not at all
            torch.cuda.synchronize()
    return time_eager(fn), "eager"


def copy_bandwidth_tbps(bytes_each: int = 2 << 30) -> float:
    """Device-to-device copy: read + write bytes over time, in TB/s."""
    src = torch.empty(bytes_each // 2, dtype=torch.bfloat16, device="cuda").normal_()  # [n]
    dst = torch.empty_like(src)
    us = time_eager(lambda: dst.copy_(src))
    return 2 * bytes_each / us / 1e6


def matmul_tflops(n: int = 8192) -> float:
    """bf16 n^3 matmul throughput in TFLOP/s (random data)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")  # [n, n]
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")  # [n, n]
    us = time_eager(lambda: a @ b)
    return 2 * n**3 / us / 1e6
