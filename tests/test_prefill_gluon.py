"""The Gluon prefill (kernels/mha/prefill_gluon.py): compiled for sm_90 here, against the float64 oracle on a Hopper GPU.

Gluon kernels do not run under the Triton interpreter, so the CPU checks what it can: the kernel builds for
Hopper (registers, shared memory, wgmma and TMA in its PTX), and the backend asked for it on a machine it cannot
serve keeps the Triton kernel and says why. On an sm_90 GPU it runs against the oracle.
"""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from attention_helpers import poison_unused_slots, rel_err, run_layer_step

from attnserve.attention.kernels.extend_tiles import build_extend_tiles
from attnserve.attention.kernels.mha import prefill_gluon
from attnserve.attention.kernels.mha.prefill_tma import request_slots
from attnserve.attention.kernels.params import LayerParams
from attnserve.attention.metadata import metadata_for_batch
from attnserve.choice.registry import backend_for_pool
from attnserve.reference.attention import reference_for_batch
from attnserve.reference.synthetic import make_batch

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")


def _compile_report(dtype: str, pingpong: bool, indirect: bool = False, *flags: str) -> dict:
    """tools/compile_prefill_gluon_sm90.py in a process of its own, which turns the interpreter off: the
    interpreter's (TRITON_INTERPRET=1) Triton functions cannot be called from a compiled kernel."""
    return _compile_tool(("--dtype", dtype, *(["--pingpong"] if pingpong else []),
                          *(["--indirect"] if indirect else []), *flags))


@functools.cache  # several tests compare against the same plain build: compiled once a process
def _compile_tool(args: tuple[str, ...]) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "compile_prefill_gluon_sm90.py"), *args],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("dtype,pingpong", [("bf16", False), ("fp16", False), ("bf16", True)])
def test_the_kernel_builds_for_sm90(dtype, pingpong):
    rep = _compile_report(dtype, pingpong)
    # (ptxas failing fails the tool, and _compile_report with it)
    assert rep["warps"] == prefill_gluon.LOADER_WARPS + 8  # the loader, two consumers
    assert rep["smem_kib"] <= 227  # Hopper's shared memory per block
    assert rep["spill_bytes"] == [0, 0] and not rep["wgmma_serialized"]
    # P's registers are left out of the wait for P.V (see the kernel): nothing may write them before that wait
    assert rep["wgmma_operand_rewrites"] == []
    # the consumers take FlashAttention-3's register share from the loader
    assert f"setmaxnreg.inc.sync.aligned.u32 {prefill_gluon.CONSUMER_REGS}" in rep["setmaxnreg"]
    assert rep["tma_loads"] >= 3  # Q, K and V through descriptors
    # 8 k-steps at each MMA site of each consumer: the first item's S, the loop's S and P.V, the last P.V, and the
    # next item's S issued behind it (waited for after the store)
    assert sum(rep["wgmma"].values()) == 2 * 5 * 8


def test_the_pingpong_build_hands_the_turn_over_through_mbarriers():
    plain, pingpong = _compile_report("bf16", False), _compile_report("bf16", True)
    # each consumer waits for its turn and hands it over around its MMA issues: the first S, each loop step, the last
    # P.V (three sites a consumer, two consumers); nothing else changes
    assert pingpong["mbarrier_waits"] - plain["mbarrier_waits"] >= 6
    assert pingpong["mbarrier_arrives"] - plain["mbarrier_arrives"] >= 6
    assert pingpong["wgmma"] == plain["wgmma"] and pingpong["tma_loads"] == plain["tma_loads"]


def test_the_indirect_build_copies_key_rows_with_cp_async_and_keeps_tma_for_the_queries():
    plain, indirect = _compile_report("bf16", False), _compile_report("bf16", False, indirect=True)
    # at its consumers' 224 registers the next item's S in flight spills 8 bytes (raced with them:
    # sweep-prefill-gluon-switches-h100-{3,4,5,6}.json, extend 1.02-1.04x)
    assert indirect["spill_bytes"][0] <= 8 and not indirect["wgmma_serialized"]
    assert indirect["wgmma_operand_rewrites"] == []
    assert indirect["async_copies"] == 2 and plain["async_copies"] == 0  # K and V, row by row
    assert indirect["tma_loads"] == 2 and plain["tma_loads"] == 4  # only the query halves through TMA
    # the consumers give the loader the registers its row addresses need
    assert f"setmaxnreg.inc.sync.aligned.u32 {prefill_gluon.INDIRECT_CONSUMER_REGS}" in indirect["setmaxnreg"]
    assert indirect["wgmma"] == plain["wgmma"] and indirect["smem_kib"] == plain["smem_kib"]


def test_three_stages_build_in_hopper_shared_memory_with_one_query_buffer():
    """The compile tool's --set: STAGES=3 (see the module) takes a third K and V slot and gives up the second
    query buffer, so its shared memory grows by one K and one V tile less one query tile (32 KiB)."""
    plain, three = _compile_report("bf16", False), _compile_report("bf16", False, False, "--set", "STAGES=3")
    assert three["switches"] == "STAGES=3" and three["spill_bytes"] == [0, 0]
    assert 227 >= three["smem_kib"] and round(three["smem_kib"] - plain["smem_kib"]) == 32


@pytest.mark.parametrize("indirect", [False, True], ids=["tma", "indirect"])
def test_the_dynamic_items_build_claims_items_with_atomics_and_keeps_the_schedule(indirect):
    plain = _compile_report("bf16", False, indirect)
    dynamic = _compile_report("bf16", False, indirect, "--set", "DYNAMIC_ITEMS=1")
    assert dynamic["spill_bytes"] == [0, 0] and not dynamic["wgmma_serialized"]
    assert dynamic["wgmma_operand_rewrites"] == []
    # the same MMAs and loads; the consumers wait once more for each query buffer (to read its item) and the
    # loader arrives once more (the last buffer, which says no item is left)
    for key in ("wgmma", "tma_loads", "async_copies", "setmaxnreg"):
        assert dynamic[key] == plain[key], key
    assert dynamic["mbarrier_waits"] > plain["mbarrier_waits"]
    assert dynamic["mbarrier_arrives"] > plain["mbarrier_arrives"]


def test_the_operand_rewrite_check_finds_a_write_before_the_wait_and_none_after():
    """compile_mla_sm90.wgmma_operand_rewrites on PTX written here: a wgmma reading A from %r5 and %r6, then a move
    into %r6 before or after the wait for every group."""
    mma = "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r1,%r2}, {%r5,%r6}, %rd1, %p1, 1, 1, 1;"
    before = "\n".join([mma, "mov.b32 %r6, {%rs1, %rs2};", "wgmma.wait_group.sync.aligned 0;"])
    after = "\n".join([mma, "wgmma.wait_group.sync.aligned 0;", "mov.b32 %r6, {%rs1, %rs2};"])
    code = ("import json, sys; sys.path.insert(0, 'tools'); from compile_mla_sm90 import wgmma_operand_rewrites as w; "
            f"print(json.dumps([w({before!r}), w({after!r})]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found_before, found_after = json.loads(proc.stdout.splitlines()[-1])
    assert found_before == ["mov.b32 %r6, {%rs1, %rs2};"] and found_after == []


def test_what_the_kernel_refuses_is_named():
    q = torch.empty(4, 2, 128, dtype=torch.bfloat16)
    assert "Hopper" in prefill_gluon.gluon_prefill_supported(q, 128, LayerParams(1.0), None)
    with pytest.raises(ValueError, match="prefill_kernel"):
        sb = make_batch([0], [4], num_heads=2, num_kv_heads=1, head_dim=128, dtype=torch.bfloat16, device=DEVICE)
        backend_for_pool("triton", sb.pool, prefill_kernel="cutlass")


@pytest.mark.skipif(HOPPER, reason="on an sm_90 GPU the Gluon kernel runs (tested below)")
def test_asked_for_where_it_cannot_run_the_triton_kernel_serves():
    sb = make_batch([0, 7], [18, 5], num_heads=8, num_kv_heads=2, head_dim=128, page_size=1, dtype=torch.bfloat16,
                    device=DEVICE, score_scale=20.0, seed=3)
    poison_unused_slots(sb)
    out, step = run_layer_step(sb, backend_for_pool("triton", sb.pool, prefill_kernel="gluon"))
    assert step.extend_path.startswith("prefill_tma") and "Gluon kernel refused" in step.extend_path
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-2


@pytest.mark.parametrize("prefill_kernel", ["auto", "gluon"])
def test_a_triton_without_gluon_keeps_the_triton_kernel_and_says_why(prefill_kernel, monkeypatch):
    """With a Triton older than Gluon's Hopper API (the gpu extra allows 3.2), importing the kernel fails: the
    default and an explicit "gluon" keep prefill_tma, the path naming what is missing, instead of raising."""
    import attnserve.attention.kernels.mha as mha_kernels

    monkeypatch.setitem(sys.modules, "attnserve.attention.kernels.mha.prefill_gluon", None)  # import -> ImportError
    monkeypatch.delattr(mha_kernels, "prefill_gluon")
    sb = make_batch([0, 7], [18, 5], num_heads=8, num_kv_heads=2, head_dim=128, page_size=1, dtype=torch.bfloat16,
                    device=DEVICE, score_scale=20.0, seed=3)
    out, step = run_layer_step(sb, backend_for_pool("triton", sb.pool, prefill_kernel=prefill_kernel))
    assert step.extend_path.startswith("prefill_tma")
    if prefill_kernel == "gluon":
        assert "has no Gluon for Hopper" in step.extend_path
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-2


class _GluonStandIn:
    """prefill_gluon_attention as the backend calls it, recorded, and run on the CPU as its contract says: with
    `slots`, request r's key n is row slots[kv_starts[r] + n] of the K/V buffers, gathered here, then
    prefill_tma (interpreted) attends over the rows."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k_rows, v_rows, kv_starts, out, tiles, qo_indptr, seq_lens, layer, pingpong=None,
                 slots=None):
        from attnserve.attention.kernels.mha import prefill_tma

        self.calls.append({"k_rows": k_rows, "v_rows": v_rows, "kv_starts": kv_starts, "slots": slots})
        if slots is not None:
            k_rows, v_rows = k_rows.index_select(0, slots.long()), v_rows.index_select(0, slots.long())
        ext = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
        prefix = [s - e for s, e in zip(seq_lens.tolist(), ext)]
        cfg = prefill_tma.default_prefill_tma_config(q.shape[-1], q.device)
        return prefill_tma.prefill_tma_attention(q, k_rows, v_rows, kv_starts, out,
                                                 build_extend_tiles(prefix, ext, cfg.block_m, q.device), qo_indptr,
                                                 seq_lens, layer, config=cfg)


@pytest.mark.skipif(HOPPER, reason="the GPU tests above run the kernel itself on these paths")
@pytest.mark.parametrize("read_pool_rows", [True, False], ids=["pool-rows", "gathered"])
@pytest.mark.parametrize("prefix", [[0, 0], [9, 30]], ids=["fresh", "prefix"])
def test_the_backend_hands_the_kernel_the_pool_and_the_slots_for_a_cached_prefix(prefix, read_pool_rows,
                                                                                   monkeypatch):
    """Where the Gluon kernel serves: a fresh prompt's own k and v; a cached prefix's pool buffers with each
    request's slot list (READ_POOL_ROWS), no gather, or the rows gathered first; the answer the oracle's."""
    sb = make_batch(prefix, [21, 7], num_heads=4, num_kv_heads=2, head_dim=128, page_size=4, dtype=torch.bfloat16,
                    device=DEVICE, score_scale=20.0, seed=5)
    poison_unused_slots(sb)
    stand_in = _GluonStandIn()
    monkeypatch.setattr(prefill_gluon, "gluon_prefill_supported", lambda *args: None)
    monkeypatch.setattr(prefill_gluon, "prefill_gluon_attention", stand_in)
    monkeypatch.setattr(prefill_gluon, "READ_POOL_ROWS", read_pool_rows)
    # a gather budget of 0 MiB: only a path that gathers nothing may serve a cached prefix
    out, step = run_layer_step(sb, backend_for_pool("triton", sb.pool, prefill_kernel="gluon",
                                                    prefill_tma_gather_mib=0 if read_pool_rows else 1024))
    assert len(stand_in.calls) == 1
    call = stand_in.calls[0]
    if any(prefix) and read_pool_rows:
        assert step.extend_path == "prefill_gluon (pool rows)"
        assert call["k_rows"].data_ptr() == sb.pool.k_buffer[0].data_ptr()  # the pool itself
        assert call["v_rows"].data_ptr() == sb.pool.v_buffer[0].data_ptr()
        assert call["slots"].dtype == torch.int32 and call["slots"].numel() == sum(sb.fb.seq_lens_cpu)
    else:
        assert step.extend_path == "prefill_gluon" and call["slots"] is None
        if not any(prefix):
            assert call["k_rows"].data_ptr() == sb.k.data_ptr()  # the call's own keys
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-2


def check_ragged_lengths(dtype: torch.dtype, group: int, prefix: list[int], pingpong: bool,
                         indirect: bool = False, page_size: int = 1,
                         extend: tuple[int, ...] = (1, 127, 128, 129, 300)) -> float:
    """The kernel on lengths on and around the 128-row tiles (one row, one tile, a tile and one), prefixes aligned
    and not, against the oracle: the relative error (asserted free of NaN). indirect: the keys read in the pool
    through their slots (the unused slots poisoned), not gathered into rows first."""
    kv_heads = 2
    sb = make_batch(prefix, list(extend), num_heads=kv_heads * group, num_kv_heads=kv_heads,
                    head_dim=128, page_size=page_size, dtype=dtype, device="cuda", score_scale=20.0, seed=group)
    poison_unused_slots(sb)
    fb, layer = sb.fb, sb.layer
    meta = metadata_for_batch(fb)
    slots = None
    if indirect:
        slots, starts = request_slots(meta.kv_indptr, meta.kv_indices, fb.seq_lens_cpu, page_size, "cuda")
        k_rows, v_rows = sb.pool.k_buffer[0], sb.pool.v_buffer[0]
    elif any(prefix):
        slots_, starts = request_slots(meta.kv_indptr, meta.kv_indices, fb.seq_lens_cpu, page_size, "cuda")
        k_rows, v_rows = sb.pool.k_buffer[0].index_select(0, slots_), sb.pool.v_buffer[0].index_select(0, slots_)
    else:
        k_rows, v_rows, starts = sb.k, sb.v, meta.qo_indptr[:-1]
    tiles = build_extend_tiles(fb.prefix_lens_cpu, fb.extend_lens_cpu, prefill_gluon.BLOCK_M, "cuda")
    out = torch.full_like(sb.q, float("nan"))  # [T, Hq, D]
    prefill_gluon.prefill_gluon_attention(sb.q, k_rows, v_rows, starts, out, tiles, meta.qo_indptr,
                                          fb.seq_lens.to(torch.int32), LayerParams(layer.scaling), pingpong=pingpong,
                                          slots=slots)
    assert not out.isnan().any()
    return rel_err(out, reference_for_batch(sb.q, layer, fb, compute_dtype=torch.float32))


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("prefix", [[0, 0, 0, 0, 0], [0, 128, 37, 1000, 5]], ids=["fresh", "prefix"])
def test_gpu_kernel_matches_oracle_on_ragged_lengths(dtype, group, prefix):
    assert check_ragged_lengths(dtype, group, prefix, pingpong=False) < 1e-2


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("prefix,page_size", [([0] * 5, 1), ([0, 128, 37, 1000, 5], 1), ([0, 128, 37, 1000, 5], 16)],
                         ids=["fresh", "prefix", "prefix-pages16"])
def test_gpu_indirect_kernel_matches_oracle_reading_the_pool(dtype, group, prefix, page_size):
    assert check_ragged_lengths(dtype, group, prefix, pingpong=False, indirect=True, page_size=page_size) < 1e-2


LONG_PREFIX, LONG_EXTEND = [0, 128, 37, 1000, 5, 0, 300], (1, 127, 128, 129, 300, 1000, 2000)


@needs_hopper
@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("indirect", [False, True], ids=["rows", "pool"])
def test_gpu_work_list_matches_oracle_over_more_items_than_sms(group, indirect):
    """Every (query tile, head) item exactly once in the KV-head-major order, each consumer's fields read two
    items ahead to the end of its list: 32 query tiles of 1 to 16 key tiles over 2 KV heads, with 1 and 8 query
    heads each (64 and 512 items, under and over an H100's or H200's SMs)."""
    assert check_ragged_lengths(torch.bfloat16, group, LONG_PREFIX, pingpong=False, indirect=indirect,
                                extend=LONG_EXTEND) < 1e-2


def in_a_child(code: str, hang_means: str, timeout_s: int = 180) -> float:
    """Run `code` (which prints one number last) in a child process with a time limit: a kernel that hangs fails
    the test, naming what a hang means, and the child's end frees the GPU where the suite's process would not."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]))
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the kernel did not finish in {timeout_s} s: {hang_means}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return float(proc.stdout.splitlines()[-1])


def check_switched(settings: str, indirect: bool, launches: int = 3) -> float:
    """The kernel with the module switches `settings` over more items than SMs, `launches` times in a row: the worst
    relative error, each launch asserted to leave the claim counter (DYNAMIC_ITEMS) at zero (a launch that did not
    would make the next skip items, and its output keep NaN)."""
    from attnserve.attention.kernels.mha.gluon_switches import gluon_settings

    errors = []
    with gluon_settings(settings):
        for _ in range(launches):
            errors.append(check_ragged_lengths(torch.bfloat16, 8, LONG_PREFIX, pingpong=False, indirect=indirect,
                                               extend=LONG_EXTEND))
            assert prefill_gluon.item_counter(torch.device("cuda")).tolist() == [0, 0]
    return max(errors)


@needs_hopper
@pytest.mark.parametrize("settings", ["DYNAMIC_ITEMS=1"])
@pytest.mark.parametrize("indirect", [False, True], ids=["rows", "pool"])
def test_gpu_switched_schedules_match_oracle_launch_after_launch_in_a_process_of_its_own(settings, indirect):
    """Items claimed through the counter: in a child process with a time limit, as a consumer never told that the
    items are over, or waiting for a tile never loaded, would hang the kernel (see the ping-pong test)."""
    error = in_a_child(f"import test_prefill_gluon as t; print(t.check_switched({settings!r}, {indirect}))",
                       "a consumer waited for an item or a tile that never came")
    assert error < 1e-2


@needs_hopper
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("prefix", [[0, 0, 0, 0, 0], [0, 128, 37, 1000, 5]], ids=["fresh", "prefix"])
def test_gpu_pingpong_matches_oracle_in_a_process_of_its_own(group, prefix):
    """The ping-pong build, not yet run on a GPU when written, in a child process with a time limit: a turn never
    handed over would hang the kernel, and the child's end frees the GPU where the suite's process would not."""
    error = in_a_child(f"import torch, test_prefill_gluon as t; "
                       f"print(t.check_ragged_lengths(torch.bfloat16, {group}, {prefix}, pingpong=True))",
                       "a turn is never handed over")
    assert error < 1e-2


@needs_hopper
@pytest.mark.parametrize("prefix,page_size", [([0] * 4, 1), ([0, 1000, 0, 37], 1), ([0, 1000, 0, 37], 16)])
def test_gpu_backend_takes_the_gluon_kernel_on_real_shapes(prefix, page_size):
    sb = make_batch(prefix, [1024, 512, 300, 700], num_heads=32, num_kv_heads=8, head_dim=128,
                    page_size=page_size, dtype=torch.bfloat16, device="cuda", score_scale=20.0)
    poison_unused_slots(sb)
    out, step = run_layer_step(sb, backend_for_pool("triton", sb.pool, prefill_kernel="gluon"))
    # a cached prefix: the keys read where they lie in the pool, not gathered
    assert step.extend_path == ("prefill_gluon (pool rows)" if any(prefix) else "prefill_gluon")
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb, compute_dtype=torch.float32)) < 1e-2


@needs_hopper
def test_gpu_features_it_lacks_stay_on_the_triton_kernel():
    sb = make_batch([37, 0], [21, 19], num_heads=4, num_kv_heads=2, head_dim=128, page_size=4,
                    dtype=torch.bfloat16, device="cuda", score_scale=20.0, sliding_window=10)
    out, step = run_layer_step(sb, backend_for_pool("triton", sb.pool, prefill_kernel="gluon"))
    assert step.extend_path.startswith("prefill_tma") and "window" in step.extend_path
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-2


def test_the_default_takes_the_gluon_kernel_only_for_long_enough_tiles():
    """Key tiles a 128-row query tile reads, on average: the measured crossover with prefill_tma."""
    assert prefill_gluon.mean_key_tiles([0] * 32, [512] * 32) == 2.5  # tiles read 1, 2, 3, 4 key tiles
    assert prefill_gluon.mean_key_tiles([0] * 8, [2048] * 8) == 8.5
    assert prefill_gluon.mean_key_tiles([4096], [512]) == 34.5
    assert prefill_gluon.mean_key_tiles([37], [1]) == 1.0 and prefill_gluon.mean_key_tiles([], []) == 0.0
    blocker = prefill_gluon.short_tiles_blocker
    assert "prefill_tma is faster" in blocker(prefill_gluon.mean_key_tiles([0] * 32, [512] * 32))
    assert blocker(prefill_gluon.mean_key_tiles([0] * 8, [2048] * 8)) is None
    assert blocker(prefill_gluon.mean_key_tiles([4096] * 8, [512] * 8)) is None


@needs_hopper
def test_gpu_default_takes_the_gluon_kernel_for_long_prompts_and_prefill_tma_for_short_ones():
    long = make_batch([0, 1000], [2048, 1536], num_heads=32, num_kv_heads=8, head_dim=128, page_size=1,
                      dtype=torch.bfloat16, device="cuda", score_scale=20.0)
    out, step = run_layer_step(long, backend_for_pool("triton", long.pool))
    assert step.extend_path == "prefill_gluon (pool rows)"
    assert rel_err(out, reference_for_batch(long.q, long.layer, long.fb, compute_dtype=torch.float32)) < 1e-2
    short = make_batch([0] * 8, [512] * 8, num_heads=32, num_kv_heads=8, head_dim=128, page_size=1,
                       dtype=torch.bfloat16, device="cuda", score_scale=20.0)
    _, step = run_layer_step(short, backend_for_pool("triton", short.pool))
    assert step.extend_path == "prefill_tma (warp-specialised)"
