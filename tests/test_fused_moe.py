"""The fused MoE kernel against the dense torch path, and the expert alignment it runs on.

On the CPU the kernel runs under TRITON_INTERPRET=1 at tiny shapes (8 experts, top-2, hidden 64, 32 channels);
on a GPU also at DeepSeek-V2-Lite's expert shapes, eagerly and replayed from a CUDA graph with new routing.
The interpreter rounds float32 to bfloat16 towards zero, so bfloat16 tolerances on the CPU are looser than
the GPU's.
"""

import pytest
import torch
from test_models_moe import HOST_SYNC_OPS, _Recorder

from attnserve.models.moe import Experts
from attnserve.ops.moe_align import align_by_expert, max_blocks
from attnserve.ops.moe_tiles import GemmTile, MoETiles

pytest.importorskip("triton")
from attnserve.ops.kernels import fused_moe
from attnserve.ops.kernels.fused_moe import fused_experts
from attnserve.ops.kernels.moe_align import LAUNCHES, AlignLaunch, align_in_one_launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTER, NUM_EXPERTS, TOP_K = 64, 32, 8, 2


def _experts(num_experts, hidden, inter, dtype, device=DEVICE, seed=0):
    experts = Experts(num_experts, hidden, inter, "silu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * hidden**-0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * inter**-0.5)
    return experts.to(device=device, dtype=dtype)


def _routing(tokens, num_experts, top_k, hidden, dtype, device=DEVICE, seed=1):
    """x [T, hidden], routing weights [T, k] float32 (normalised) and distinct expert ids [T, k]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dtype)
    weights, ids = torch.rand(tokens, num_experts, generator=g).topk(top_k, dim=-1)
    return x, (weights / weights.sum(-1, keepdim=True)).to(device), ids.to(device)


def _float64_oracle(experts, x, weights, ids):
    """The dense path (every expert on every token, weighted by 0 where unrouted) in float64."""
    ref = Experts(experts.num_experts, x.shape[1], experts.intermediate_size, "silu").double()
    ref.load_state_dict({k: v.double().cpu() for k, v in experts.state_dict().items()})
    return ref.forward_dense(x.double().cpu(), weights.double().cpu(), ids.cpu())


def _rel_err(out, ref):
    return ((out.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


# ---- alignment -------------------------------------------------------------------------------------------

# (tokens, top_k, experts, block_m, shared experts)
ALIGN_CASES = [(1, 6, 64, 16, 0), (1, 6, 64, 16, 2), (3, 2, 8, 16, 0), (17, 2, 8, 16, 1), (40, 3, 4, 32, 0),
               (30, 4, 5, 16, 2)]
SINGLE_PROGRAM = [AlignLaunch(32, num_warps=1), AlignLaunch(128, num_warps=4)]  # LAUNCHES has a program per expert


def _ids(tokens, top_k, num_experts):
    g = torch.Generator().manual_seed(tokens)
    return torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])  # [T, k]


@pytest.mark.parametrize("tokens,top_k,num_experts,block_m,shared", ALIGN_CASES)
def test_alignment_groups_every_pair_once_by_expert_in_token_order(tokens, top_k, num_experts, block_m, shared):
    ids = _ids(tokens, top_k, num_experts)
    a = align_by_expert(ids, num_experts, block_m, shared)
    shared_ids = torch.arange(num_experts, num_experts + shared).expand(tokens, shared)  # [T, S]
    flat = torch.cat((ids, shared_ids), dim=1).reshape(-1)  # [P] every pair's expert, shared ones last
    pairs, num_experts = flat.numel(), num_experts + shared
    blocks = max_blocks(pairs, num_experts, block_m)
    assert a.sorted_pairs.shape == (blocks * block_m,) and a.block_expert.shape == (blocks,)
    rows = a.sorted_pairs.view(blocks, block_m)
    real = rows < pairs
    assert sorted(rows[real].tolist()) == list(range(pairs))  # every pair exactly once, padding = pairs
    used = 0
    for b in range(blocks):
        e = int(a.block_expert[b])
        if e == num_experts:  # past the last group: no pairs
            assert not real[b].any()
            continue
        used += 1
        members = rows[b][real[b]]
        assert (flat[members.long()] == e).all()  # one expert per block
        assert members.tolist() == sorted(members.tolist())  # stable: token order kept
        assert real[b][: len(members)].all()  # padding only at a group's end
    assert used == sum(-(-int((flat == e).sum()) // block_m) for e in range(num_experts))
    assert a.block_expert.tolist() == sorted(a.block_expert.tolist())


@pytest.mark.parametrize("tokens,top_k,num_experts,block_m,shared", ALIGN_CASES)
def test_one_launch_alignment_equals_the_torch_ops(tokens, top_k, num_experts, block_m, shared):
    """More pairs than the programs' chunk, an expert count that is not a power of two, shared experts; a program
    per expert (the shipped launch), and one program."""
    ids = _ids(tokens, top_k, num_experts).to(DEVICE)
    a = align_by_expert(ids, num_experts, block_m, shared)
    for launch in (None, *SINGLE_PROGRAM):
        b = align_in_one_launch(ids, num_experts, block_m, shared, launch)
        assert torch.equal(a.sorted_pairs, b.sorted_pairs) and torch.equal(a.block_expert, b.block_expert), launch


@pytest.mark.parametrize("launch", sorted({launch for _, launch in LAUNCHES} | {AlignLaunch(64, 64, 4), *SINGLE_PROGRAM},
                                          key=repr))
def test_every_launch_setting_aligns_like_the_torch_ops(launch):
    """The launch settings by size (and the single program's) walk several chunks and fills: same alignment."""
    ids = _ids(40, 6, 64).to(DEVICE)  # 40 tokens x (6 + 2 shared): 320 pairs
    a = align_by_expert(ids, 64, 16, 2)
    b = align_in_one_launch(ids, 64, 16, 2, launch)
    assert torch.equal(a.sorted_pairs, b.sorted_pairs) and torch.equal(a.block_expert, b.block_expert)


def test_one_token_touches_only_its_experts():
    """Decode at batch 1: as many row blocks as chosen experts, whatever the expert count."""
    ids = torch.tensor([[60, 3, 17, 41, 8, 29]])  # [1, 6]
    a = align_by_expert(ids, 64, 16)
    assert a.block_expert.tolist() == [3, 8, 17, 29, 41, 60]


def test_alignment_reads_nothing_back_to_the_host():
    ids = torch.randint(0, 8, (5, 2))
    with _Recorder() as rec:
        align_by_expert(ids, 8, 16)
    assert not rec.ops & HOST_SYNC_OPS, rec.ops & HOST_SYNC_OPS


# ---- the kernel against the dense path -----------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2 if DEVICE == "cpu" else 1e-2)])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_fused_experts_match_the_dense_path(tokens, dtype, tol):
    experts = _experts(NUM_EXPERTS, HIDDEN, INTER, dtype)
    x, weights, ids = _routing(tokens, NUM_EXPERTS, TOP_K, HIDDEN, dtype)
    out = fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids)
    assert out.shape == x.shape and out.dtype == dtype
    ref = _float64_oracle(experts, x, weights, ids)
    assert _rel_err(out, ref) < tol
    assert _rel_err(out, experts.forward_dense(x, weights, ids)) < tol


@pytest.mark.parametrize("shared", [0, 2])
def test_one_token_launches_no_alignment(shared, monkeypatch):
    """Batch-1 decode: each choice is its own row block, its expert read from the ids; two tokens still align."""
    from attnserve.ops.kernels import fused_moe

    aligned = []
    plain = fused_moe.align
    monkeypatch.setattr(fused_moe, "align", lambda *a, **k: aligned.append(a[0].shape[0]) or plain(*a, **k))
    experts = _experts(NUM_EXPERTS, HIDDEN, INTER, torch.float32)
    shared_gate_up, shared_down = _shared_weights(HIDDEN, INTER, shared) if shared else (None, None)
    for tokens in (1, 2):
        x, weights, ids = _routing(tokens, NUM_EXPERTS, TOP_K, HIDDEN, torch.float32)
        out = fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, shared_gate_up=shared_gate_up,
                            shared_down=shared_down)
        ref = _float64_oracle(experts, x, weights, ids)
        if shared:
            ref = ref + _shared_oracle(x, shared_gate_up, shared_down)
        assert _rel_err(out, ref) < 1e-5
    assert aligned == [2]


def test_uneven_widths_and_wider_row_blocks(monkeypatch):
    """Channels and hidden size that no tile divides (masked loads), 32-row blocks, the torch alignment."""
    monkeypatch.setattr(fused_moe, "ONE_LAUNCH_ALIGN_MAX_PAIRS", 0)
    experts = _experts(4, 48, 24, torch.float32)
    x, weights, ids = _routing(9, 4, 3, 48, torch.float32)
    tiles = MoETiles(32, GemmTile(16, 32, 4, 1), GemmTile(32, 16, 4, 1))
    out = fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, tiles=tiles)
    assert _rel_err(out, _float64_oracle(experts, x, weights, ids)) < 1e-5


def test_no_tokens_and_bad_shapes():
    experts = _experts(NUM_EXPERTS, HIDDEN, INTER, torch.float32)
    x, weights, ids = _routing(0, NUM_EXPERTS, TOP_K, HIDDEN, torch.float32)
    assert fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids).shape == (0, HIDDEN)
    x, weights, ids = _routing(2, NUM_EXPERTS, TOP_K, HIDDEN, torch.float32)
    with pytest.raises(ValueError, match="one dtype"):
        fused_experts(x.double(), experts.gate_up_proj, experts.down_proj, weights, ids)
    with pytest.raises(ValueError, match="down_proj"):
        fused_experts(x, experts.gate_up_proj, experts.down_proj.transpose(1, 2), weights, ids)
    with pytest.raises(ValueError, match="adds a contiguous"):
        fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, add=x[:1])


def _shared_weights(hidden, inter, count, dtype=torch.float32, seed=9):
    """A shared MLP of count x inter channels: gate_up [2 * count * inter, hidden] (gate rows first), down."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(2 * count * inter, hidden, generator=g) * hidden**-0.5
    down = torch.randn(hidden, count * inter, generator=g) * (count * inter) ** -0.5  # [hidden, count * inter]
    return gate_up.to(device=DEVICE, dtype=dtype), down.to(device=DEVICE, dtype=dtype)


def _shared_oracle(x, gate_up, down):
    gate, up = (x.double().cpu() @ gate_up.double().cpu().T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ down.double().cpu().T  # [T, hidden]


@pytest.mark.parametrize("tokens", [1, 5])
def test_shared_experts_run_as_more_experts_of_the_same_gemms(tokens):
    """A shared MLP of 2 x 32 channels is two more experts every token takes with weight 1."""
    experts = _experts(NUM_EXPERTS, HIDDEN, INTER, torch.float32)
    x, weights, ids = _routing(tokens, NUM_EXPERTS, TOP_K, HIDDEN, torch.float32)
    shared_gate_up, shared_down = _shared_weights(HIDDEN, INTER, 2)
    out = fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, shared_gate_up=shared_gate_up,
                        shared_down=shared_down)
    ref = _float64_oracle(experts, x, weights, ids) + _shared_oracle(x, shared_gate_up, shared_down)
    assert _rel_err(out, ref) < 1e-5
    with pytest.raises(ValueError, match="multiple of 32 channels"):
        fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, shared_gate_up=shared_gate_up[:-2],
                      shared_down=shared_down[:, :-1])


def test_the_shared_experts_output_is_added_in_the_last_pass():
    experts = _experts(NUM_EXPERTS, HIDDEN, INTER, torch.float32)
    x, weights, ids = _routing(3, NUM_EXPERTS, TOP_K, HIDDEN, torch.float32)
    shared = torch.randn(x.shape).to(DEVICE)  # [T, hidden]
    out = fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, add=shared)
    assert _rel_err(out, _float64_oracle(experts, x, weights, ids) + shared.double().cpu()) < 1e-5


def test_the_triton_op_set_carries_the_kernel_and_says_so():
    """What the engine picks on CUDA has it (and the start-up line names it); the CPU's and
    `--disable-fused-ops`' sets do not."""
    from attnserve.ops import select_ops, triton_ops

    ops = triton_ops()
    assert ops.fused_moe is fused_experts and "MoE experts as two grouped GEMMs" in ops.describe()
    assert select_ops("cpu").fused_moe is None and select_ops("cuda", fused=False).fused_moe is None


# ---- GPU: DeepSeek-V2-Lite's expert shapes, CUDA graphs --------------------------------------------------

V2_LITE = {"num_experts": 64, "hidden": 2048, "inter": 1408, "top_k": 6}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 512])
def test_fused_experts_at_deepseek_v2_lite_shapes(tokens):
    """Routed experts alone, and with the two shared experts as more experts of the same GEMMs."""
    experts = _experts(V2_LITE["num_experts"], V2_LITE["hidden"], V2_LITE["inter"], torch.bfloat16)
    x, weights, ids = _routing(tokens, V2_LITE["num_experts"], V2_LITE["top_k"], V2_LITE["hidden"], torch.bfloat16)
    out = fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids)
    routed = experts.forward_dense(x, weights, ids)  # bf16 on the GPU: a float64 oracle on the host takes seconds
    assert _rel_err(out, routed) < 1e-2
    shared = _shared_weights(V2_LITE["hidden"], V2_LITE["inter"], 2, torch.bfloat16)
    out = fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, shared_gate_up=shared[0],
                        shared_down=shared[1])
    assert _rel_err(out, routed.double().cpu() + _shared_oracle(x, *shared)) < 1e-2


@pytest.mark.gpu
@gpu
def test_fused_experts_replay_from_a_cuda_graph_with_new_routing():
    """Captured once (shared experts included), replayed with other routing in the same buffers: the result
    follows the routing."""
    experts = _experts(V2_LITE["num_experts"], 256, 128, torch.bfloat16)
    shared = _shared_weights(256, 128, 2, torch.bfloat16)
    x, weights, ids = _routing(4, V2_LITE["num_experts"], V2_LITE["top_k"], 256, torch.bfloat16)

    def run():
        return fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, shared_gate_up=shared[0],
                             shared_down=shared[1])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in (2, 3):
        new_x, new_weights, new_ids = _routing(4, V2_LITE["num_experts"], V2_LITE["top_k"], 256, torch.bfloat16,
                                               seed=seed)
        x.copy_(new_x), weights.copy_(new_weights), ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        ref = _float64_oracle(experts, x, weights, ids) + _shared_oracle(x, *shared)
        assert _rel_err(out, ref) < 1e-2
