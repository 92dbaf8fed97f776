"""The TMA prefill path (kernels/mha/prefill_tma.py) against the float64 oracle, and the backend's choice of path.

On the CPU the kernel runs under TRITON_INTERPRET=1, tensor descriptors included (the interpreter
implements them, zero fill past a tensor's end too), with tiles that do not divide the lengths.
With CUDA (an H200) the same tests run compiled, warp-specialised, plus real shapes.
"""

import dataclasses

import pytest
import torch
from attention_helpers import poison_unused_slots, rel_err, run_layer, run_layer_step

from attnserve.attention.kernels.extend_tiles import build_extend_tiles
from attnserve.attention.kernels.gpu_target import GpuTarget
from attnserve.attention.kernels.mha.configs import fast_path_blocker
from attnserve.attention.kernels.mha.prefill_tma import (
    PrefillTmaConfig,
    check_warp_specialized,
    default_prefill_tma_config,
    prefill_tma_attention,
    request_slots,
    tma_rows_ok,
)
from attnserve.attention.kernels.params import LayerParams
from attnserve.attention.metadata import metadata_for_batch
from attnserve.batch import ForwardMode
from attnserve.choice.registry import backend_for_pool
from attnserve.reference.attention import reference_for_batch
from attnserve.reference.synthetic import make_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SMALL = PrefillTmaConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, warp_specialize=False)
# block_n 32 > block_m: several programs' diagonals inside one key tile. Compiled, the H200's shapes too.
SHAPES = [SMALL, PrefillTmaConfig(16, 32, 4, 1, False), PrefillTmaConfig(16, 16, 4, 1, False, mask_every_tile=False),
          PrefillTmaConfig(16, 16, 4, 1, False, persistent=1), PrefillTmaConfig(16, 32, 4, 1, device_descriptors=True),
          PrefillTmaConfig(16, 16, 4, 1, False, persistent=1, kv_head_major=True)]
if torch.cuda.is_available():  # the H200's tiles: unspecialised, persistent, and the warp-specialised default
    SHAPES += [PrefillTmaConfig(128, 64, 8, 3), PrefillTmaConfig(128, 128, 8, 2, persistent=1),
               PrefillTmaConfig(128, 128, 4, 2, True, device_descriptors=True),
               PrefillTmaConfig(128, 128, 4, 2, True, persistent=1, device_descriptors=True),
               PrefillTmaConfig(128, 128, 4, 2, True, persistent=1, device_descriptors=True, kv_head_major=True)]


def _gathered_rows(sb):
    """Every request's keys as contiguous rows, the way the backend gathers them when there is a prefix."""
    fb, pool = sb.fb, sb.pool
    meta = metadata_for_batch(fb)
    slots, starts = request_slots(meta.kv_indptr, meta.kv_indices, fb.seq_lens_cpu, pool.page_size, pool.device)
    return pool.k_buffer[0].index_select(0, slots), pool.v_buffer[0].index_select(0, slots), starts


def test_request_slots_follow_each_requests_tokens():
    sb = make_batch([5, 0, 13], [4, 7, 2], num_heads=2, num_kv_heads=1, head_dim=16, page_size=4, device=DEVICE)
    fb = sb.fb
    meta = metadata_for_batch(fb)
    slots, starts = request_slots(meta.kv_indptr, meta.kv_indices, fb.seq_lens_cpu, 4, DEVICE)
    expected = torch.cat([fb.req_to_token[r, :s].long() for r, s in zip(fb.req_pool_indices.tolist(), fb.seq_lens_cpu)])
    assert slots.dtype == torch.int32 and torch.equal(slots.long().cpu(), expected.cpu())
    assert starts.tolist() == [0, 9, 16]


@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: (f"{c.block_m}x{c.block_n}-ws{int(c.warp_specialize)}-every{int(c.mask_every_tile)}"
                                                 f"-p{c.persistent}-dev{int(c.device_descriptors)}-kv{int(c.kv_head_major)}"))
@pytest.mark.parametrize("prefix", [[0, 0, 0], [29, 0, 6]], ids=["fresh", "prefix"])
def test_kernel_matches_oracle_on_ragged_lengths(cfg, prefix):
    """Lengths that divide no tile, GQA 4, fresh prompts from the call's own k/v or prefixes gathered from the pool."""
    sb = make_batch(prefix, [37, 11, 18], num_heads=8, num_kv_heads=2, head_dim=128, page_size=4,
                    dtype=torch.bfloat16, device=DEVICE, score_scale=20.0, seed=cfg.block_n + sum(prefix))
    poison_unused_slots(sb)
    fb, layer = sb.fb, sb.layer
    meta = metadata_for_batch(fb)
    if any(prefix):
        k_rows, v_rows, starts = _gathered_rows(sb)
    else:
        k_rows, v_rows, starts = sb.k, sb.v, meta.qo_indptr[:-1]
    tiles = build_extend_tiles(fb.prefix_lens_cpu, fb.extend_lens_cpu, cfg.block_m, DEVICE)
    out = torch.full((sb.q.shape[0], 8, 128), float("nan"), dtype=torch.bfloat16, device=DEVICE)  # [T, Hq, D]
    prefill_tma_attention(sb.q, k_rows, v_rows, starts, out, tiles, meta.qo_indptr, fb.seq_lens.to(torch.int32),
                          LayerParams(layer.scaling), config=cfg)
    assert not out.isnan().any()
    assert rel_err(out, reference_for_batch(sb.q, layer, fb)) < 1e-2


@pytest.mark.parametrize("feature", [{"sliding_window": 10}, {"use_sinks": True}, {"logit_cap": 6.0},
                                     {"sliding_window": 17, "use_sinks": True, "logit_cap": 5.0}],
                         ids=["window", "sinks", "softcap", "all"])
def test_backend_takes_the_tma_path_with_each_feature(feature):
    sb = make_batch([37, 0, 2], [21, 19, 30], num_heads=4, num_kv_heads=2, head_dim=128, page_size=4,
                    dtype=torch.bfloat16, device=DEVICE, score_scale=20.0, seed=len(feature), **feature)
    poison_unused_slots(sb)
    backend = backend_for_pool("triton", sb.pool, prefill_tma=True)
    out, step = run_layer_step(sb, backend)
    assert step.extend_path.startswith("prefill_tma")
    assert not out.isnan().any()
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-2


@pytest.mark.parametrize("prefix", [[0, 0], [19, 50]], ids=["fresh", "prefix"])
def test_common_case_takes_the_tma_path_by_default(prefix):
    """Causal GQA in bf16 at head_dim 128, with and without a cached prefix, page size 1 and 16."""
    for page_size in (1, 16):
        sb = make_batch(prefix, [18, 5], num_heads=8, num_kv_heads=2, head_dim=128, page_size=page_size,
                        dtype=torch.bfloat16, device=DEVICE, score_scale=20.0, seed=page_size)
        poison_unused_slots(sb)
        backend = backend_for_pool("triton", sb.pool)
        out, step = run_layer_step(sb, backend)
        assert step.extend_path.startswith("prefill_tma"), step.extend_path
        if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
            assert step.extend_path == "prefill_tma (warp-specialised)"
        assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-2


def test_warp_specialized_configs_outside_the_measured_shape_are_refused():
    """Host descriptors hung, 64-key tiles over 3 stages gave NaN, other head dims are unmeasured (NOTES.md)."""
    good = PrefillTmaConfig(128, 128, 4, 2, True, persistent=1, device_descriptors=True)
    check_warp_specialized(good, 128)
    check_warp_specialized(PrefillTmaConfig(128, 64, 8, 3, False), 64)  # unspecialised: anything goes
    bad = {"host descriptors": dataclasses.replace(good, device_descriptors=False),
           "128x64 over 3 stages": dataclasses.replace(good, block_n=64, num_stages=3),
           "mask_every_tile": dataclasses.replace(good, mask_every_tile=False)}
    for reason, cfg in bad.items():
        with pytest.raises(ValueError, match=reason):
            check_warp_specialized(cfg, 128)
    with pytest.raises(ValueError, match="head_dim 64"):
        check_warp_specialized(good, 64)
    sb = make_batch([0], [8], num_heads=2, num_kv_heads=1, head_dim=128, dtype=torch.bfloat16, device=DEVICE)
    tiles = build_extend_tiles([0], [8], 128, DEVICE)
    meta = metadata_for_batch(sb.fb)
    with pytest.raises(ValueError, match="refused"):  # before anything is launched
        prefill_tma_attention(sb.q, sb.k, sb.v, meta.qo_indptr[:-1], torch.empty_like(sb.q), tiles, meta.qo_indptr,
                              sb.fb.seq_lens.to(torch.int32), LayerParams(1.0), config=bad["128x64 over 3 stages"])
    assert default_prefill_tma_config(128, "cuda") == good  # the sm90 default


FALLBACKS = {
    "custom-mask": ({"custom_mask": True, "mode": ForwardMode.TARGET_VERIFY}, "custom mask"),
    "fp8": ({"kv_dtype": "fp8_e4m3"}, "FP8"),
    "d80": ({"head_dim": 80}, "head_dim 80"),
    "asymmetric-v": ({"v_head_dim": 32}, "V head dim"),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_what_the_tma_path_lacks_falls_back_to_the_paged_kernel(case):
    kw, reason = FALLBACKS[case]
    kw = {"head_dim": 64} | kw
    sb = make_batch([12, 3], [9, 14], num_heads=4, num_kv_heads=2, page_size=4, dtype=torch.bfloat16,
                    device=DEVICE, score_scale=20.0, seed=len(case), **kw)
    poison_unused_slots(sb)
    backend = backend_for_pool("triton", sb.pool)
    out, step = run_layer_step(sb, backend)
    assert step.extend_path.startswith("paged") and reason in step.extend_path
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-2
    with pytest.raises(ValueError, match="does not apply"):
        run_layer(sb, backend_for_pool("triton", sb.pool, prefill_tma=True))


def test_the_tma_path_can_be_switched_off_and_bounded():
    sb = make_batch([40, 0], [8, 8], num_heads=4, num_kv_heads=2, head_dim=64, page_size=1, dtype=torch.bfloat16,
                    device=DEVICE, seed=4)
    backend = backend_for_pool("triton", sb.pool, prefill_tma=False)
    _, step = run_layer_step(sb, backend)
    assert step.extend_path == "paged (TMA path off)"
    backend = backend_for_pool("triton", sb.pool, prefill_tma_gather_mib=0)  # the prefix may not be gathered
    out, step = run_layer_step(sb, backend)
    assert "gathering the prefix" in step.extend_path
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 1e-2


def test_blockers_and_layouts():
    hopper, ampere = GpuTarget.of((9, 0)), GpuTarget.of((8, 0))
    common = {"head_dim": 128, "v_dim": 128, "q_dtype": torch.bfloat16, "kv_dtype": torch.bfloat16,
              "custom_mask": None, "interpreting": False}
    assert fast_path_blocker(**common, target=hopper) is None
    assert "sm90" in fast_path_blocker(**common, target=ampere)
    assert "float32" in fast_path_blocker(**common | {"q_dtype": torch.float32, "kv_dtype": torch.float32},
                                          target=hopper)
    fused = torch.zeros(10, 8 + 2 + 2, 64)  # [T, q + k + v heads, D]: k is a strided view, still readable
    assert tma_rows_ok(fused[:, 8:10]) and tma_rows_ok(fused)
    assert not tma_rows_ok(fused.transpose(0, 1)) and not tma_rows_ok(fused[:, :, :32])


@gpu
@needs_cuda
@pytest.mark.parametrize("prefix,page_size", [([0] * 4, 1), ([0, 1000, 0, 37], 1), ([0, 1000, 0, 37], 16)])
def test_gpu_real_shapes_on_the_tma_path(prefix, page_size):
    sb = make_batch(prefix, [1024, 512, 300, 700], num_heads=32, num_kv_heads=8, head_dim=128,
                    page_size=page_size, dtype=torch.bfloat16, device="cuda", score_scale=20.0)
    poison_unused_slots(sb)
    backend = backend_for_pool("triton", sb.pool)
    out, step = run_layer_step(sb, backend)
    if torch.cuda.get_device_capability()[0] == 9:
        assert step.extend_path.startswith("prefill_tma")
    assert not out.isnan().any()
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb, compute_dtype=torch.float32)) < 1e-2


def _launch_arguments(monkeypatch, batches) -> list[dict]:
    """The named arguments of every _prefill_tma_kernel launch the backend makes for these batches."""
    import inspect

    from attnserve.attention.kernels.mha import prefill_tma as module

    kernel = module._prefill_tma_kernel
    names = list(inspect.signature(kernel.fn).parameters)
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append({**dict(zip(names, args)), **kwargs})
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, "_prefill_tma_kernel", Recorder())
    for sb in batches:
        tiles = build_extend_tiles(sb.fb.prefix_lens_cpu, sb.fb.extend_lens_cpu, SMALL.block_m, DEVICE)
        meta = metadata_for_batch(sb.fb)
        k_rows, v_rows, starts = _gathered_rows(sb)
        out = torch.empty_like(sb.q)
        prefill_tma_attention(sb.q, k_rows, v_rows, starts, out, tiles, meta.qo_indptr, sb.fb.seq_lens.to(torch.int32),
                              LayerParams(sb.layer.scaling), config=SMALL)
    return launches


def test_no_integer_that_changes_between_steps_is_specialised(monkeypatch):
    """A served mix of steps must not make Triton compile new variants mid-serving: every integer argument whose
    value differs between two steps of one layer (token counts, key rows, work items) is left unspecialised."""
    from attnserve.attention.kernels.mha import prefill_tma as module

    steps = [make_batch(prefix, ext, num_heads=8, num_kv_heads=2, head_dim=128, page_size=4, dtype=torch.bfloat16,
                        device=DEVICE, seed=i)
             for i, (prefix, ext) in enumerate([([0, 0], [16, 16]), ([29, 3], [17, 1]), ([5], [1]), ([300], [47])])]
    kernel = module._prefill_tma_kernel
    launches = _launch_arguments(monkeypatch, steps)
    assert len(launches) == len(steps)
    varying = {name for name, value in launches[0].items()
               if isinstance(value, int) and not isinstance(value, bool)
               and any(launch[name] != value for launch in launches[1:])}
    assert {"q_rows", "kv_rows"} <= varying  # the check sees the sizes that do change
    declared = set(getattr(kernel, "do_not_specialize", None) or kernel.kwargs.get("do_not_specialize") or ())
    assert varying <= declared, f"specialised on per-step sizes: {sorted(varying - declared)}"


@gpu
@needs_cuda
def test_gpu_one_compiled_variant_serves_every_token_count():
    """The compiled kernel for a layer serves steps of any token count: none compiles mid-serving."""
    from attnserve.attention.kernels.mha import prefill_tma as module

    kernel = module._prefill_tma_kernel
    cfg = default_prefill_tma_config(128, torch.device("cuda"))

    def variants() -> int:
        return sum(len(cache[0]) for cache in kernel.device_caches.values())

    counts = []
    for prefix, ext in [([0, 0], [16, 16]), ([29, 3], [17, 1]), ([5], [1]), ([300], [47]), ([1000, 37], [700, 33])]:
        sb = make_batch(prefix, ext, num_heads=32, num_kv_heads=8, head_dim=128, page_size=1, dtype=torch.bfloat16,
                        device="cuda", score_scale=20.0)
        meta = metadata_for_batch(sb.fb)
        k_rows, v_rows, starts = _gathered_rows(sb)
        tiles = build_extend_tiles(sb.fb.prefix_lens_cpu, sb.fb.extend_lens_cpu, cfg.block_m, "cuda")
        out = torch.empty_like(sb.q)
        prefill_tma_attention(sb.q, k_rows, v_rows, starts, out, tiles, meta.qo_indptr, sb.fb.seq_lens.to(torch.int32),
                              LayerParams(sb.layer.scaling), config=cfg)
        assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb, compute_dtype=torch.float32)) < 1e-2
        counts.append(variants())
    assert counts[-1] == counts[0], f"compiled variants after each step: {counts}"
