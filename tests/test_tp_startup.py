"""Tensor parallelism without processes: which slice each rank holds and reads, and every start-up
refusal (tp not splitting the model, too few GPUs, a port in use, bad topologies), which must come
before any weights are read or any rank is spawned."""

from __future__ import annotations

import multiprocessing
import socket

import pytest
import torch
from tp_helpers import TINY_LLAMA_TP, write_checkpoint

from attnserve.distributed.launch import Topology, check_devices
from attnserve.distributed.shard import check_split, unit_slice
from attnserve.distributed.state import as_rank
from attnserve.engine import startup
from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine
from attnserve.models import loader


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return write_checkpoint(TINY_LLAMA_TP, tmp_path_factory.mktemp("tiny-llama-startup"), seed=1)


def test_kv_heads_are_replicated_when_tp_exceeds_them_and_query_heads_never_are():
    assert [unit_slice(2, 8, r, 4, allow_replicas=True).first for r in range(4)] == [0, 0, 1, 1]
    assert [unit_slice(8, 8, r, 4).start for r in range(4)] == [0, 16, 32, 48]
    with pytest.raises(ValueError, match="does not divide the 2 query heads"):
        check_split(2, 4, "query heads")  # a replicated query head would be summed twice by o_proj
    with pytest.raises(ValueError, match="tp size 4 does not divide the 6 KV heads"):
        check_split(6, 4, "KV heads", allow_replicas=True)


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_loads_its_rows_of_each_merged_part(llama_path, tp):
    """q|k|v and gate|up are split part by part: rank r's fused weight is [q_r; k_r; v_r], [gate_r; up_r]."""
    whole = loader.load_model(llama_path).model
    qkv = whole.layers[0].self_attn.qkv_proj.weight  # [(8 + 2 + 2) * 8, 64]
    q, k, v = qkv.split([64, 16, 16])
    gate, up = whole.layers[1].mlp.gate_up_proj.weight.chunk(2)  # each [128, 64]
    down = whole.layers[1].mlp.down_proj.weight  # [64, 128]
    emb = whole.embed_tokens.weight
    for rank in range(tp):
        with as_rank(rank, tp):
            part = loader.load_model(llama_path).model
        kv_head = rank * 2 // tp  # one KV head per rank at tp 4: ranks 0, 1 share head 0
        kv_rows = slice(kv_head * 8, (kv_head + max(1, 2 // tp)) * 8)
        q_rows = slice(rank * 64 // tp, (rank + 1) * 64 // tp)
        ch = slice(rank * 128 // tp, (rank + 1) * 128 // tp)
        assert torch.equal(part.layers[0].self_attn.qkv_proj.weight, torch.cat((q[q_rows], k[kv_rows], v[kv_rows])))
        assert torch.equal(part.layers[1].mlp.gate_up_proj.weight, torch.cat((gate[ch], up[ch])))
        assert torch.equal(part.layers[1].mlp.down_proj.weight, down[:, ch])
        rows = emb.shape[0] // tp
        assert torch.equal(part.embed_tokens.weight, emb[rank * rows : (rank + 1) * rows])
        assert part.kv_cache_spec().num_kv_heads == max(1, 2 // tp)


@pytest.mark.needs_embedded_model
def test_gguf_slices_decode_only_their_rows_and_blocks_and_equal_the_whole():
    from attnserve.models.gguf_loader import GGUFFile

    gf = GGUFFile(loader.embedded_model_path())
    wanted = {"model.layers.0.self_attn.q_proj.weight": 0, "model.layers.0.self_attn.k_proj.weight": 0,
              "model.layers.0.mlp.down_proj.weight": 1, "model.layers.0.self_attn.o_proj.weight": 1}
    seen = 0
    for name, lazy in gf.tensors(gf.hf_config(), torch.float32):
        if name in wanted:
            dim, whole = wanted[name], lazy.read()
            n = whole.shape[dim] // 3  # SmolLM2 at tp 3: whole heads (q/k are llama.cpp-permuted) and whole blocks
            assert torch.equal(lazy.narrow(dim, n, n), whole.narrow(dim, n, n)), name
            seen += 1
    assert seen == len(wanted)


@pytest.mark.needs_embedded_model
def test_tp_not_splitting_the_heads_is_refused_before_loading(monkeypatch):
    def no_loading(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(startup, "load_model", no_loading)
    with pytest.raises(ValueError, match=r"--tp-size 2 cannot split .*9 query heads.*divisors of 9"):
        Engine(EngineConfig(device="cpu", tp_size=2))  # the embedded SmolLM2: 9 query / 3 KV heads
    assert not multiprocessing.active_children()


def test_a_port_in_use_is_refused_before_spawning(llama_path):
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match=f"--dist-init-addr port {port} is in use"):
            Engine(EngineConfig(model=str(llama_path), device="cpu", tp_size=2, dist_init_addr=f"127.0.0.1:{port}"))
    assert not multiprocessing.active_children()


def test_too_few_gpus_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="needs 4 GPUs on this machine, found 2"):
        check_devices(torch.device("cuda"), Topology(4))
    check_devices(torch.device("cuda"), Topology(4, nnodes=2, node_rank=1, dist_init_addr="h:1"))  # 2 per node


@pytest.mark.parametrize(("settings", "message"), [
    ({"tp_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "must be a multiple of --nnodes 2"),
    ({"tp_size": 2, "nnodes": 2}, "needs --dist-init-addr HOST:PORT"),
    ({"tp_size": 2, "dist_init_addr": "nohost"}, "HOST:PORT"),
    ({"tp_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, r"--node-rank must be in \[0, 2\)"),
    ({"tp_size": 0}, "--tp-size must be >= 1"),
])
def test_bad_topologies_are_refused_by_the_config(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_a_model_already_in_memory_cannot_be_split(llama_path):
    bundle = loader.load_model(llama_path)
    with pytest.raises(ValueError, match="pass the model by path"):
        Engine(EngineConfig(device="cpu", tp_size=2), loaded=bundle)
