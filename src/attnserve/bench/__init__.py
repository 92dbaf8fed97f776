"""Benchmarks: kernel races (`attnserve bench kernels`); each writes JSON and a chart."""
