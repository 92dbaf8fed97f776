"""Launch one Gluon MLA decode kernel (and, when split, its merge) a few times on one workload at 128 heads, page
1: the program benchmarks/ncu_mla_decode.sh profiles.

    PYTHONPATH=src:benchmarks python3 benchmarks/mla_decode_once.py REQUESTS CONTEXT SPLITS [gluon_colsplit|gluon_seesaw]
"""

import sys

import mla_split_cost
import torch

import attnserve.attention.kernels.mla_decode_gluon as gluon_host
from attnserve.attention.kernels.decode import partial_strides
from attnserve.attention.kernels.merge_tiled import merge_splits_tiled


def main() -> int:
    requests, seq, splits = (int(x) for x in sys.argv[1:4])
    kernel = sys.argv[4] if len(sys.argv) > 4 else "gluon_colsplit"
    q, kv, kv_indptr, kv_indices, seq_lens, num_splits, out, po, pl = mla_split_cost.inputs(
        requests, 128, seq, 1, splits, torch.float32, "own")
    for _ in range(4):  # ncu --launch-skip 3 profiles the fourth, compiled and warm
        gluon_host.launch_mla_decode_gluon(q, kv, out, po, pl, kv_indptr, kv_indices, seq_lens, num_splits, splits, 1,
                                           576 ** -0.5, splits == 1, partial_strides(po, pl), kernel=kernel)
        if splits > 1:
            merge_splits_tiled(out, po, pl, num_splits, splits, 1.0)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
