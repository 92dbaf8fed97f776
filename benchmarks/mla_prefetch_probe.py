"""L2 prefetch of the next round's latent rows in the seesaw producer, timed against the shipped kernel in one run.

"pf-end": the nine 128-byte lines of each of the next round's rows prefetched after this round's copies; "pf-mid":
between the two stages' copies. Pages "own" (scattered, HBM) and "hot" (a 4 MB window, L2). Printed rows only.
"""
import json, sys
sys.path.insert(0, "benchmarks")
import torch
import mla_split_cost as m

HELPER = '''
@gluon.jit
def _pf_line(ptr):
    gl.inline_asm_elementwise("prefetch.global.L2 [$1];\\n\\tmov.u32 $0, 0;", "=r,l", [ptr], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _pf_rows(KV, rows, stride_kvt):
    row_ptr = KV + rows * stride_kvt
    for k in gl.static_range(9):
        _pf_line(row_ptr + k * 64)


@gluon.jit
def _row_token_head('''
ANCHOR = '''        _copy_columns(c_ring.index(1), base1, QUARTER, QUARTER, ROPE)
        async_copy.mbarrier_arrive(loaded_e.index(1), increment_count=False)
'''
def variant(name, where):
    src = m.SEESAW.read_text().replace("\n@gluon.jit\ndef _row_token_head(", HELPER, 1)
    body = "        if 2 * j + 2 < num_tiles:\n            _pf_rows(KV, rows0, stride_kvt)\n            _pf_rows(KV, rows1, stride_kvt)\n"
    if where == "end":
        src = src.replace(ANCHOR, ANCHOR + body)
    elif where == "mid":  # after stage 0's copies
        a = "        mbarrier.wait(free_l.index(1), phase, pred=j > 0)\n"
        src = src.replace(a, body + a)
    import importlib.util, pathlib, tempfile
    path = pathlib.Path(tempfile.mkdtemp()) / f"seesaw_{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"seesaw_{name}", path)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod._mla_decode_seesaw_kernel

kernels = {"shipped": m.gluon_host._mla_decode_seesaw_kernel, "pf-end": variant("pfend", "end"),
           "pf-mid": variant("pfmid", "mid")}
rows = []
for rep in range(2):
    for name, k in kernels.items():
        for pages_of in ("own", "hot"):
            for tiles in (8, 16):
                us = m.time_variant(k, 1, 128, 64 * 64 * tiles, 1, 64, torch.float32, False, pages_of)
                rows.append(dict(kernel=name, pages=pages_of, case=f"1x{4096*tiles}", us=round(us, 2)))
                print(rows[-1], flush=True)
        us = m.time_variant(k, 128, 128, 4096, 1, 1, torch.float32, False, "own")
        rows.append(dict(kernel=name, pages="own", case="128x4096", us=round(us, 2))); print(rows[-1], flush=True)
