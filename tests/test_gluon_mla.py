"""The Gluon MLA decode kernel (Hopper): compiled for sm_90 on any machine, run against the oracle on an H100/H200.

Gluon has no interpreter, so the CPU checks what can be checked without the GPU: the kernel compiles for sm_90
with ptxas (no spills, one CTA's shared memory within Hopper's 227 KB), its tile is validated, and asking for it
where it cannot run fails with the reason while the default falls back to the Triton kernel (whose numbers the
CPU tests cover under the interpreter).
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from attention_helpers import rel_err
from test_triton_mla import poison_unused_latent

from attnserve.attention.kernels.mla.attention import mla_decode_attention
from attnserve.attention.kernels.mla.decode_table import MLADecodeConfig, rules_from_sweep
from attnserve.attention.kernels.params import DecodeRows
from attnserve.attention.kernels.resolve import plan_for_call
from attnserve.attention.metadata import metadata_for_batch
from attnserve.reference.attention import reference_for_batch
from attnserve.reference.synthetic import make_batch

GLUON = MLADecodeConfig(64, 64, 8, 2, kernel="gluon_seesaw")
SCORER = MLADecodeConfig(64, 64, 8, 2, kernel="gluon_scorer")
SCORER_FP16 = dataclasses.replace(SCORER, partials="float16")
NARROW = MLADecodeConfig(16, 64, 8, 2, kernel="gluon_narrow")
ROOT = Path(__file__).resolve().parents[1]
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def deepseek_batch(prefix, page_size, heads, device, seed=0):
    sb = make_batch(prefix, [1] * len(prefix), num_heads=heads, mla=(512, 64), page_size=page_size,
                    dtype=torch.bfloat16, device=device, score_scale=8.0, seed=seed)
    poison_unused_latent(sb)
    return sb


def run(sb, splits, write_final, config):
    fb, lay = sb.fb, sb.layer
    meta = metadata_for_batch(fb)
    dev = sb.q.device
    out = torch.full((fb.batch_size, lay.num_heads, 512), float("nan"), dtype=torch.bfloat16, device=dev)
    num_splits = torch.tensor(splits, dtype=torch.int32, device=dev)
    plan = plan_for_call(sb.q, sb.pool.kv_buffer[0], 512, sb.pool.page_size, config)
    rows = DecodeRows(meta.kv_indptr, meta.kv_indices, fb.seq_lens, num_splits, max(splits), sb.pool.page_size)
    return mla_decode_attention(sb.q, sb.pool.kv_buffer[0], out, rows, plan, lay.scaling, write_final=write_final)


def test_gluon_tile_is_fixed_and_recorded_by_sweeps():
    with pytest.raises(ValueError, match="tile is fixed"):
        MLADecodeConfig(32, 64, 8, 2, kernel="gluon_seesaw")
    with pytest.raises(ValueError, match="'triton', 'gluon_seesaw'"):
        MLADecodeConfig(kernel="cuda")
    assert GLUON.for_heads(16) == GLUON  # one 64-row wgmma; the kernel masks heads past 16
    with pytest.raises(ValueError, match="gluon_narrow MLA kernel's tile is fixed: block_h 16 or 32"):
        MLADecodeConfig(64, 64, 8, 2, kernel="gluon_narrow")
    with pytest.raises(ValueError, match="no deferred PV"):
        MLADecodeConfig(16, 64, 8, 2, defer_pv=True, kernel="gluon_narrow")
    wide = dataclasses.replace(NARROW, block_h=32)
    assert wide.for_heads(16) == NARROW and wide.for_heads(8) == NARROW and wide.for_heads(128) == wide
    rows = [{"workload": "w", **dataclasses.asdict(GLUON), "us": 10.0},
            {"workload": "w", **dataclasses.asdict(MLADecodeConfig(64, 64, 8, 2)), "us": 20.0}]
    (rule,) = rules_from_sweep(rows, {"w": (128, 1)})
    assert rule["config"]["kernel"] == "gluon_seesaw"
    assert MLADecodeConfig(**rule["config"]) == GLUON


def test_gluon_asked_for_where_it_cannot_run_says_why():
    sb = deepseek_batch([40], 1, 16, "cpu")
    with pytest.raises(ValueError, match="CUDA device"):
        run(sb, [1], True, GLUON)


def compile_offline(*args: str) -> dict:
    """tools/compile_mla_sm90.py's JSON report, from a fresh process (the interpreter's jitted helpers cannot
    compile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools/compile_mla_sm90.py"), *args, "--json"],
                          check=False, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("page_size", [1, 64])
def test_gluon_mla_decode_compiles_for_sm90(page_size):
    """Compiled offline with Triton's ptxas: a shared-memory overflow, a changed MMA split or a jump in spills
    shows here before any GPU run."""
    report = compile_offline("--gluon", str(page_size))
    assert report["smem_kib"] <= 227  # one CTA per SM on Hopper
    # each warpgroup: its tiles' whole score (512 + 64 wide, k16 steps: 36 a call site; three sites, warpgroup 0's
    # round, its odd last tile and warpgroup 1's round) and 256 output columns (4 steps a site, six sites);
    # warps_per_cta [4, 1]: nothing computed twice
    assert report["wgmma"] == {"m64n64k16": 108, "m64n256k16": 24}
    assert report["mma"] == [["4, 1", "16, 64, 16"], ["4, 1", "16, 256, 16"]]
    # the consumers hold a 64 x 256 float32 output (128 registers) at a 232-register budget, the producer its next
    # round's page indices in 40-odd: the spills measured with the race's numbers (308-356 B) are allowed, more
    # than 512 B is not
    assert report["spill_bytes"][0] <= 512, report
    # the output leaves through shared memory, 16 contiguous bytes a thread (each warpgroup's 64 x 256 float32
    # partials: 32 stores a thread), not in the wgmma layout's 8-byte pieces; the LSE is one float a row
    assert report["global_stores"] == {"st.global.v4.b32": 64, "st.global.b32": 2}, report


@pytest.mark.parametrize("page_size", [1, 64])
def test_scorer_gluon_mla_decode_compiles_for_sm90(page_size):
    """Warpgroup 0 scores a whole tile (36 steps, 512 + 64 wide) and multiplies its 256 output columns (4 steps),
    warpgroup 1 copies every tile and multiplies the other 256: one call site each, nothing spilled, the wgmmas
    asynchronous. Over 64-token pages a tile is nine TMA boxes (three sites: tiles 0 and 1, the refill), over
    single tokens 36 cp.async a thread (the query's 9 either way); q, q_pe and two 72 KB stages fit."""
    report = compile_offline("--gluon", str(page_size), "--gluon-kernel", "gluon_scorer")
    assert report["wgmma"] == {"m64n64k16": 36, "m64n256k16": 8}, report
    assert not report["wgmma_serialized"], report
    assert report["spill_bytes"] == [0, 0], report
    assert 216 < report["smem_kib"] <= 227, report
    assert report["global_stores"] == {"st.global.v4.b32": 64, "st.global.b32": 2}, report
    assert report["tma_loads"] == (3 * 9 if page_size == 64 else 0), report
    assert report["async_copies"] == (9 if page_size == 64 else 36), report


@pytest.mark.parametrize("heads", [128, 16])
def test_the_seesaw_without_the_mask_on_whole_tiles_stays_asynchronous(heads):
    """SEESAW_WHOLE_TILES: the same wgmmas, still asynchronous, the spills within the seesaw's allowance."""
    args = ("--gluon", "1", "--gluon-heads", str(heads))
    plain, whole = compile_offline(*args), compile_offline(*args, "--set", "SEESAW_WHOLE_TILES=1")
    assert whole["wgmma"] == plain["wgmma"] and not whole["wgmma_serialized"], whole
    assert whole["spill_bytes"][0] <= 512 and whole["wgmma_operand_rewrites"] == [], whole
    for key in ("global_stores", "async_copies", "smem_kib"):
        assert whole[key] == plain[key], key


@pytest.mark.parametrize("args", [("--gluon", "1", "--gluon-kernel", "gluon_scorer", "--scaled"),
                                  ("--gluon", "16", "--gluon-kernel", "gluon_scorer")], ids=["p1", "p16"])
def test_the_scorers_copier_never_waits_for_the_next_tiles_indices_in_the_loop(args):
    """The scorer's copier computes a tile's pool rows at its copy, so the loop's loads of page indices are not read
    in their own block: 3 loads are, 7 when the rows were computed at the load (the warp then waited a load's latency
    every tile); the wgmmas asynchronous and nothing spilled."""
    report = compile_offline(*args)
    assert report["loads_used_in_block"] <= 3, report
    assert not report["wgmma_serialized"] and report["wgmma_operand_rewrites"] == [], report
    assert report["spill_bytes"][0] == 0, report


@pytest.mark.parametrize("args", [("--gluon", "1"), ("--gluon", "64"), ("--gluon", "1", "--gluon-heads", "16")],
                         ids=["p1", "p64", "h16"])
def test_seesaw_pages_ahead_leaves_no_wait_for_the_next_tiles_indices_in_the_loop(args):
    """SEESAW_PAGES_AHEAD: the producer's loads of the next tiles' page indices are no longer read in their own block
    (4 or more fewer), with the same wgmmas, still asynchronous, the same copies and stores, the spills within the
    seesaw's allowance."""
    plain, ahead = compile_offline(*args), compile_offline(*args, "--set", "SEESAW_PAGES_AHEAD=1")
    assert ahead["loads_used_in_block"] <= plain["loads_used_in_block"] - 4, (plain, ahead)
    assert ahead["wgmma"] == plain["wgmma"] and not ahead["wgmma_serialized"], ahead
    assert ahead["wgmma_operand_rewrites"] == [], ahead
    assert ahead["spill_bytes"][0] <= 512, ahead
    for key in ("global_stores", "async_copies", "tma_loads", "smem_kib"):
        assert ahead[key] == plain[key], key


def test_the_load_wait_check_finds_a_read_in_the_block_and_none_past_a_branch():
    """compile_mla_sm90.loads_used_in_block on PTX written here: a loaded register read before the branch, and one
    read only after it."""
    load = "ld.global.b32 { %r7 }, [ %rd1 + 0 ];"
    inside = "\n".join([load, "cvt.s64.s32 %rd2, %r7;", "bra.uni $L__BB0_3;"])
    past = "\n".join([load, "add.s32 %r70, %r71, 1;", "bra.uni $L__BB0_3;", "$L__BB0_3:", "cvt.s64.s32 %rd2, %r7;"])
    code = ("import json, sys; sys.path.insert(0, 'tools'); from compile_mla_sm90 import loads_used_in_block as f; "
            f"print(json.dumps([f({inside!r}), f({past!r})]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == [1, 0]


@pytest.mark.parametrize("kernel", ["gluon_scorer"])
def test_float16_partials_compile_for_sm90(kernel):
    """float16 partials, each row's power of two beside it: the same wgmmas, still asynchronous, nothing
    spilled; 16-byte stores of the float16 halves (16 a thread: converted before the shared-memory staging) and
    2-byte ones of the scale."""
    report = compile_offline("--gluon", "1", "--gluon-kernel", kernel, "--scaled")
    assert report["wgmma"] == {"m64n64k16": 36, "m64n256k16": 8}, report
    assert not report["wgmma_serialized"], report
    assert report["spill_bytes"] == [0, 0], report
    assert report["smem_kib"] <= 227, report
    assert report["global_stores"] == {"st.global.v4.b32": 32, "st.global.b16": 2, "st.global.b32": 2}, report


@pytest.mark.parametrize("page_size, heads", [(1, 16), (64, 16), (1, 128)])
def test_narrow_gluon_mla_decode_compiles_for_sm90(page_size, heads):
    """The keys-major kernel: 36 score steps (576 wide) and 8 x 4 PV steps of m64nHk16 (H: 16 heads, or 32 a CTA
    of 128), nothing else, no spills, two 72 KB stages within Hopper's shared memory."""
    report = compile_offline("--gluon", str(page_size), "--gluon-kernel", "gluon_narrow", "--gluon-heads", str(heads))
    n = 16 if heads <= 16 else 32
    assert report["wgmma"] == {f"m64n{n}k16": 68}
    assert report["mma"] == [["4, 1", f"16, {n}, 16"]]
    assert report["spill_bytes"] == [0, 0], report
    assert 144 < report["smem_kib"] <= 227


@pytest.mark.skipif(not HOPPER, reason="the Gluon MLA kernel runs on Hopper; its CPU coverage is above")
@pytest.mark.parametrize("page_size", [1, 64, 16])
def test_narrow_gluon_mla_decode_matches_oracle(page_size):
    """Heads as the wgmma's columns: 16 heads, 8 (half the columns masked), 32, and 128 as four 32-head CTAs;
    ragged lengths, splits forced on and off."""
    for heads, block_h in ((16, 16), (8, 16), (32, 32), (128, 32)):
        sb = deepseek_batch([70, 1, 300, 129, 64], page_size, heads, "cuda", seed=page_size + heads)
        ref = reference_for_batch(sb.q, sb.layer, sb.fb, compute_dtype=torch.float32)
        config = dataclasses.replace(NARROW, block_h=block_h)
        for splits, final in (([1] * 5, True), ([1] * 5, False), ([2, 1, 5, 3, 1], False), ([7] * 5, False)):
            out = run(sb, splits, final, config)
            assert not out.isnan().any(), (heads, splits, final)
            assert rel_err(out, ref) < 1e-2, (heads, splits, final, rel_err(out, ref))


@pytest.mark.skipif(not HOPPER, reason="the Gluon MLA kernel runs on Hopper; its CPU coverage is above")
@pytest.mark.parametrize("config", [GLUON, SCORER], ids=lambda c: c.kernel)
@pytest.mark.parametrize("page_size", [1, 64, 16])
def test_gluon_mla_decode_matches_oracle(page_size, config):
    """Ragged lengths (partial last tiles, odd and even tile counts, a 1-token request), splits forced on and
    off, 128 and 16 heads."""
    for heads in (128, 16):
        sb = deepseek_batch([70, 1, 300, 129, 64], page_size, heads, "cuda", seed=page_size + heads)
        ref = reference_for_batch(sb.q, sb.layer, sb.fb, compute_dtype=torch.float32)
        for splits, final in (([1] * 5, True), ([1] * 5, False), ([2, 1, 5, 3, 1], False), ([7] * 5, False)):
            out = run(sb, splits, final, config)
            assert not out.isnan().any(), (heads, splits, final)
            assert rel_err(out, ref) < 1e-2, (heads, splits, final, rel_err(out, ref))


def check_scorer_switched(settings: str, page_size: int) -> float:
    """The scorer with the Gluon launch's switches `settings` (ragged lengths, splits forced on and off, empty
    splits, float32 and float16 partials, 128 heads): the worst relative error, each output asserted free of NaN."""
    from attnserve.attention.kernels.mha.gluon_switches import MLA_DECODE, gluon_settings

    errors = []
    sb = deepseek_batch([70, 1, 300, 129, 64, 33], page_size, 128, "cuda", seed=page_size)
    ref = reference_for_batch(sb.q, sb.layer, sb.fb, compute_dtype=torch.float32)
    with gluon_settings(settings, MLA_DECODE):
        for config in (SCORER, SCORER_FP16):
            for splits, final in (([1] * 6, True), ([1] * 6, False), ([2, 1, 5, 3, 1, 2], False), ([7] * 6, False)):
                if config is SCORER_FP16 and final:
                    continue
                out = run(sb, splits, final, config)
                assert not out.isnan().any(), (config.partials, splits, final)
                errors.append(rel_err(out, ref))
    return max(errors)


@pytest.mark.skipif(not HOPPER, reason="the Gluon MLA kernel runs on Hopper; the scaled merge's CPU coverage is "
                                       "test_triton_mla.py's, the compile's above")
@pytest.mark.parametrize("config", [SCORER_FP16], ids=lambda c: c.kernel)
@pytest.mark.parametrize("page_size", [1, 64])
def test_float16_partials_match_oracle(page_size, config):
    """Ragged lengths, splits forced on, empty splits, 128 and 16 heads, through the merge kernel."""
    for heads in (128, 16):
        sb = deepseek_batch([70, 1, 300, 129, 64], page_size, heads, "cuda", seed=page_size + heads)
        ref = reference_for_batch(sb.q, sb.layer, sb.fb, compute_dtype=torch.float32)
        for splits in ([2, 1, 5, 3, 1], [7] * 5):
            out = run(sb, splits, False, config)
            assert not out.isnan().any(), (heads, splits)
            assert rel_err(out, ref) < 1e-2, (heads, splits, rel_err(out, ref))


@pytest.mark.skipif(not HOPPER, reason="the Gluon MLA kernel runs on Hopper; the scaled merge's CPU coverage is "
                                       "test_triton_mla.py's")
@pytest.mark.parametrize("config", [SCORER_FP16], ids=lambda c: c.kernel)
@pytest.mark.parametrize("magnitude", [1e6, 1e-6])
def test_float16_partials_hold_any_bf16_range(magnitude, config):
    """Latent values far past float16's range (or far below its normal range) still merge to the oracle: each
    partial row is stored scaled by its own power of two."""
    sb = deepseek_batch([700, 1, 3000], 1, 128, "cuda", seed=3)
    sb.pool.kv_buffer[0][..., :512] *= magnitude  # the values; the scores see q . latent, so q shrinks with it
    sb.q[..., :512] /= magnitude
    ref = reference_for_batch(sb.q, sb.layer, sb.fb, compute_dtype=torch.float32)
    out = run(sb, [6, 1, 9], False, config)
    assert out.isfinite().all()
    assert rel_err(out, ref) < 1e-2, rel_err(out, ref)


@pytest.mark.skipif(not HOPPER, reason="the Gluon MLA kernel runs on Hopper; the decode-row plan's CPU coverage is "
                                       "test_triton_mla.py's")
@pytest.mark.parametrize("page_size", [1, 64])
def test_gluon_mla_extend_as_decode_rows_is_the_default(page_size):
    """The backend's absorbed extend runs as Gluon decode rows at 128 heads (a token a CTA) and at 32 and 16 (2
    and 4 tokens a CTA, each row masked to its own horizon), and matches the oracle: a fresh prompt, chunks over
    prefixes, short tails over long prefixes; the few-token batch is split."""
    assert extend_rows_error(page_size) < 1e-2


def extend_rows_error(page_size: int) -> float:
    """test_gluon_mla_extend_as_decode_rows_is_the_default's batches: the worst relative error, each step's path
    and split asserted, each output free of NaN."""
    from attention_helpers import run_layer_step

    from attnserve.batch import ForwardMode
    from attnserve.choice.registry import backend_for_pool

    errors = []
    batches = (([0, 1000, 37, 4096], [512, 256, 301, 3]), ([4096, 3000, 5], [3, 6, 2]))
    for heads, tokens in ((128, 1), (32, 2), (16, 4)):
        for (prefix, ext), split in zip(batches, (False, True)):
            sb = make_batch(prefix, ext, num_heads=heads, mla=(512, 64), page_size=page_size, dtype=torch.bfloat16,
                            device="cuda", score_scale=2.0, mode=ForwardMode.EXTEND, seed=heads + len(prefix))
            poison_unused_latent(sb)
            backend = backend_for_pool("triton", sb.pool)
            out, step = run_layer_step(sb, backend)
            path = f"mla decode rows (gluon_seesaw, {tokens} token{'s' * (tokens > 1)} a CTA)"
            assert step.extend_path == path
            assert step.extend.mla_rows[0].max_splits > 1 or not split, (heads, prefix)
            assert not out.isnan().any(), (heads, prefix)
            errors.append(rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb, compute_dtype=torch.float32)))
    return max(errors)


def check_extend_rows_switched(settings: str, page_size: int) -> float:
    """extend_rows_error with the Gluon launch's switches `settings`."""
    from attnserve.attention.kernels.mha.gluon_switches import MLA_DECODE, gluon_settings

    with gluon_settings(settings, MLA_DECODE):
        return extend_rows_error(page_size)


@pytest.mark.skipif(not HOPPER, reason="the Gluon MLA kernel runs on Hopper; its compile is checked above")
@pytest.mark.parametrize("page_size", [1, 64])
def test_the_seesaw_without_the_mask_on_whole_tiles_matches_oracle(page_size):
    """SEESAW_WHOLE_TILES: rows of 1, 2 and 4 tokens a CTA, the mask left off only below every row's horizon."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]))
    code = f"import test_gluon_mla as t; print(t.check_extend_rows_switched('SEESAW_WHOLE_TILES=1', {page_size}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert float(proc.stdout.splitlines()[-1]) < 1e-2
