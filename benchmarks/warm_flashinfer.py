"""Build FlashInfer's JIT kernels for the race shapes (32/8 heads, d128, bf16; MLA 512 + 64) on tiny inputs.

Run in the background at the start of a GPU run, so the minutes of nvcc work overlap
with the Triton runs and the race finds the kernels built.
"""

from __future__ import annotations

import sys
import time

import torch

from attnserve.bench.racers import (
    build_race_batch,
    flashinfer_decode_racer,
    flashinfer_mla_racer,
    flashinfer_prefill_racer,
)
from attnserve.bench.workloads import MLAShape, Workload


def main() -> None:
    jobs = [
        ("mla fa3", Workload("warm mla", "decode", 2, 63, 1, 1, MLAShape(16)),
         lambda rb: flashinfer_mla_racer(rb, "fa3")),
        ("mla fa2", Workload("warm mla", "decode", 2, 63, 1, 1, MLAShape(16)),
         lambda rb: flashinfer_mla_racer(rb, "fa2")),
        ("decode tensor cores", Workload("warm decode", "decode", 2, 63, 1, 1),
         lambda rb: flashinfer_decode_racer(rb, tensor_cores=True)),
        ("prefill fa3 ragged", Workload("warm prefill", "prefill", 2, 0, 64, 1),
         lambda rb: flashinfer_prefill_racer(rb, "fa3")),
        ("extend fa3 paged", Workload("warm extend", "extend", 2, 64, 64, 1),
         lambda rb: flashinfer_prefill_racer(rb, "fa3")),
        ("prefill fa2 ragged", Workload("warm prefill", "prefill", 2, 0, 64, 1),
         lambda rb: flashinfer_prefill_racer(rb, "fa2")),
        ("extend fa2 paged", Workload("warm extend", "extend", 2, 64, 64, 1),
         lambda rb: flashinfer_prefill_racer(rb, "fa2")),
    ]
    wanted = sys.argv[1:]  # substrings of the labels to build; all when empty
    for label, w, make in jobs:
        if wanted and not any(x in label for x in wanted):
            continue
        start = time.perf_counter()
        try:
            rb = build_race_batch(w)
            make(rb)()
            torch.cuda.synchronize()
            print(f"{label}: built in {time.perf_counter() - start:.0f} s", flush=True)
        except Exception as exc:  # noqa: BLE001 - report and go on to the next kernel
            print(f"{label}: failed after {time.perf_counter() - start:.0f} s: {exc}", flush=True)


if __name__ == "__main__":
    main()
