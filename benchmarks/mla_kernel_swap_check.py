"""Run the column-split kernel's GPU oracle tests (tests/test_gluon_mla.py) with another kernel in its place.

    PYTHONPATH=src python3 benchmarks/mla_kernel_swap_check.py scorer
"""

import pathlib
import sys
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import test_gluon_mla as t  # noqa: E402
from mla_colsplit_variants import VARIANTS  # noqa: E402

import attnserve.attention.kernels.mla_decode_gluon as gluon_host  # noqa: E402

gluon_host._mla_decode_colsplit_kernel = VARIANTS[sys.argv[1]]
failed = 0
for name, call in [(f"oracle p{p}", lambda p=p: t.test_gluon_mla_decode_matches_oracle(p, t.COLSPLIT)) for p in (1, 16, 64)] + \
        [(f"fp16 partials p{p}", lambda p=p: t.test_colsplit_float16_partials_match_oracle(p)) for p in (1, 64)] + \
        [(f"range {m}", lambda m=m: t.test_colsplit_float16_partials_hold_any_bf16_range(m)) for m in (1e6, 1e-6)]:
    try:
        call()
        print("PASS", name, flush=True)
    except Exception:  # noqa: BLE001
        failed += 1
        print("FAIL", name, traceback.format_exc(limit=2)[-800:], flush=True)
sys.exit(1 if failed else 0)
