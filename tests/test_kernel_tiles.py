"""Tile configurations per GPU architecture and the shared-memory check, on the CPU (a target is passed in)."""

import pytest
import torch

from attnserve.attention.kernels.gpu_target import (
    GpuTarget,
    TileShape,
    check_shared_memory,
    fewest_stages_dropped,
    shared_memory_bytes,
)
from attnserve.attention.kernels.mha.configs import DECODE_TILES, DecodeConfig, default_decode_config
from attnserve.attention.kernels.mha.decode import decode_attention
from attnserve.attention.kernels.mha.extend import (
    EXTEND_TILES,
    ExtendConfig,
    build_extend_tiles,
    default_extend_config,
    extend_attention,
)
from attnserve.attention.kernels.params import DecodeRows, ExtendRows, LayerParams
from attnserve.attention.metadata import metadata_for_batch
from attnserve.reference.synthetic import make_batch

TARGETS = {"sm80": GpuTarget.of((8, 0)), "sm86": GpuTarget.of((8, 6)), "sm89": GpuTarget.of((8, 9)),
           "sm90": GpuTarget.of((9, 0)), "default": GpuTarget.of((7, 5))}


def test_targets_name_their_table_and_budget():
    assert {k: t.arch for k, t in TARGETS.items()} == {k: k for k in TARGETS}
    assert TARGETS["sm90"].smem_bytes == 227 * 1024 and TARGETS["sm86"].smem_bytes == 99 * 1024
    assert GpuTarget.of((9, 0), smem_bytes=1000).smem_bytes == 1000
    assert set(DECODE_TILES) == set(EXTEND_TILES) == set(TARGETS)


@pytest.mark.parametrize("arch", sorted(TARGETS))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_every_default_fits_its_architecture(arch, head_dim):
    target = TARGETS[arch]
    for page_size in (1, 16):
        c = default_decode_config(head_dim, page_size, target)
        check_shared_memory("decode", TileShape(16, head_dim, c.block_n, 2 * head_dim, c.num_stages, 2), target)
    c = default_extend_config(head_dim, "cuda", target)
    check_shared_memory("extend", TileShape(c.block_m, head_dim, c.block_n, 2 * head_dim, c.num_stages, 2), target)


def test_architectures_get_their_own_tiles():
    hopper = default_extend_config(128, "cuda", TARGETS["sm90"])
    ada = default_extend_config(128, "cuda", TARGETS["sm89"])
    assert (hopper.block_m, hopper.num_stages) == (128, 3)
    assert shared_memory_bytes(TileShape(128, 128, 64, 256, 3, 2)) > TARGETS["sm89"].smem_bytes  # why Ada differs
    assert (ada.block_m, ada.num_stages) == (64, 2)
    assert default_decode_config(128, 1, TARGETS["sm90"]).block_n == 128
    assert default_decode_config(128, 1, TARGETS["sm86"]).num_stages == 2
    assert default_extend_config(128, "cpu").block_m == 16  # the interpreter's small tiles


def test_float32_defaults_drop_stages_to_fit():
    def shape(c):
        return TileShape(c.block_m, 128, c.block_n, 256, c.num_stages, 4)

    c = fewest_stages_dropped(ExtendConfig(128, 64, 4, 3), shape, TARGETS["sm90"])
    assert c.num_stages == 2 and c.block_m == 128


def test_hopper_tiles_on_a_small_gpu_fail_before_launch_with_a_clear_error():
    sb = make_batch([30, 5], [1, 1], num_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    fb = sb.fb
    meta = metadata_for_batch(fb)
    out = torch.empty(2, 8, 128, dtype=torch.bfloat16)
    small = GpuTarget.of((8, 6))
    with pytest.raises(ValueError, match=r"decode: .* need about \d+ KiB .*sm86\) allows 99 KiB"):
        rows = DecodeRows(meta.kv_indptr, meta.kv_indices, fb.seq_lens, torch.ones(2, dtype=torch.int32), 1, 1)
        decode_attention(sb.q, sb.pool.k_buffer[0], sb.pool.v_buffer[0], out, rows, LayerParams(sb.layer.scaling),
                         config=DecodeConfig(block_n=256, num_warps=4, num_stages=4), target=small)
    ext = make_batch([0, 7], [20, 9], num_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    m = metadata_for_batch(ext.fb)
    hopper = ExtendConfig(128, 64, 4, 3)
    tiles = build_extend_tiles(ext.fb.prefix_lens_cpu, ext.fb.extend_lens_cpu, hopper.positions_per_tile(4), "cpu")
    with pytest.raises(ValueError, match="extend: .*choose smaller block sizes or fewer stages"):
        extend_attention(ext.q, ext.pool.k_buffer[0], ext.pool.v_buffer[0], torch.empty(29, 8, 128),
                         ExtendRows(tiles, m.qo_indptr, m.kv_indptr, m.kv_indices, ext.fb.seq_lens, 1),
                         LayerParams(ext.layer.scaling), config=hopper, target=small)
