"""Speculative verify attention (TARGET_VERIFY) against the float oracle: chains and random trees.

Every request runs q = 1 + K tokens (its last token, then K drafts). A chain is causal and passes no mask; a
tree passes per request a mask `[q, prefix + q]` whose prefix part is all visible and whose new-token part is
ancestor-or-self. The CUDA-graph path plans the compact `[bs, q, q]` mask instead (the prefix visible to every
row) into fixed buffers: captured with one batch, replayed with others, it must give the same answers.

CPU: TRITON_INTERPRET=1 and tiny shapes. The graph path's planning runs here without a graph (a replay
re-runs what the capture recorded on the same buffers); tests/test_spec_verify_graph.py replays real graphs.
"""

import pytest
import torch
from attention_helpers import rel_err, run_layer, run_layer_step

from attnserve.attention.backends.torch_native import TorchNativeBackend
from attnserve.batch import ForwardBatch, ForwardMode
from attnserve.choice.registry import backend_for_pool
from attnserve.reference.attention import reference_for_batch
from attnserve.reference.synthetic import make_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MLA = (32, 16)  # DeepSeek's latent + rope, scaled down


def random_tree_masks(bs: int, q: int, gen: torch.Generator) -> torch.Tensor:
    """bool `[bs, q, q]`: token 0 is the root, token i > 0 hangs under a random earlier token; a token sees
    its ancestors and itself."""
    masks = torch.zeros(bs, q, q, dtype=torch.bool)
    for b in range(bs):
        for i in range(q):
            parent = -1 if i == 0 else int(torch.randint(0, i, (1,), generator=gen))
            masks[b, i, i] = True
            if parent >= 0:
                masks[b, i] |= masks[b, parent]
    return masks


def full_masks(tree: torch.Tensor, prefix_lens: list[int]) -> torch.Tensor:
    """The contract's flattened per-request `[q, prefix + q]` masks of compact tree masks `[bs, q, q]`."""
    q = tree.shape[1]
    return torch.cat([torch.cat([torch.ones(q, p, dtype=torch.bool), t], dim=1).reshape(-1)
                      for t, p in zip(tree, prefix_lens)])


def verify_batch(prefix_lens, q, tree, page_size, mla, seed=0):
    """A TARGET_VERIFY batch of q tokens per request; returns (batch, compact tree masks or None)."""
    sb = make_batch(prefix_lens, [q] * len(prefix_lens), num_heads=4, num_kv_heads=2, head_dim=32,
                    page_size=page_size, mla=MLA if mla else None, mode=ForwardMode.TARGET_VERIFY,
                    dtype=torch.float32 if DEVICE == "cpu" else torch.bfloat16, device=DEVICE, seed=seed,
                    score_scale=4.0)
    compact = None
    if tree:
        compact = random_tree_masks(len(prefix_lens), q, torch.Generator().manual_seed(seed + 1))
        sb.fb.custom_mask = full_masks(compact, prefix_lens).to(DEVICE)
    return sb, compact


def tolerance():
    return 1e-4 if DEVICE == "cpu" else 2e-2


def test_random_trees_are_ancestor_closed():
    masks = random_tree_masks(3, 6, torch.Generator().manual_seed(0))
    assert masks[:, 0, 1:].sum() == 0  # the root sees only itself among the new tokens
    assert bool(masks.diagonal(dim1=1, dim2=2).all())
    assert not bool(masks.triu(1).any())  # parents come first
    # a tree, not only chains: some token skips its predecessor
    assert any(not masks[b, i, i - 1] for b in range(3) for i in range(2, 6))


CASES = [  # backend, mla, page size, tree
    ("triton", False, 1, False), ("triton", False, 1, True), ("triton", False, 16, True),
    ("triton", True, 1, False), ("triton", True, 16, True),
    ("torch_native", False, 16, True), ("torch_native", False, 1, False), ("torch_native", True, 1, True),
]


@pytest.mark.parametrize("name,mla,page_size,tree", CASES)
def test_verify_matches_oracle(name, mla, page_size, tree):
    sb, _ = verify_batch([3, 17, 40], 5, tree, page_size, mla, seed=page_size + 7 * tree)
    backend = backend_for_pool("triton", sb.pool) if name == "triton" else TorchNativeBackend(sb.pool)
    out, step = run_layer_step(sb, backend)
    ref = reference_for_batch(sb.q, sb.layer, sb.fb)
    assert rel_err(out, ref) < tolerance()
    if name == "triton" and not mla:  # GQA-packed tiles sized to the step: one tile a request and KV head
        assert step.extend_path.startswith("paged")
        assert [t.num_tiles for t in step.extend.tiles.values()] == [3]


def test_triton_verify_never_takes_the_tma_prefill_path():
    """A shape the TMA prefill kernel would take (bf16, head_dim 64): a verify step stays on the paged kernel."""
    sb = make_batch([12, 30], [4, 4], num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                    device=DEVICE, mode=ForwardMode.TARGET_VERIFY, score_scale=4.0)
    backend = backend_for_pool("triton", sb.pool)
    out, step = run_layer_step(sb, backend)
    assert step.extend_path == "paged (verify step)"
    assert rel_err(out, reference_for_batch(sb.q, sb.layer, sb.fb)) < 2e-2
    with pytest.raises(ValueError, match="does not apply"):
        run_layer(sb, backend_for_pool("triton", sb.pool, prefill_tma=True))


def test_a_tree_mask_changes_the_answer():
    """The tree's mask is read: the same batch under the causal rule differs."""
    sb, _ = verify_batch([9, 20], 4, True, 1, False, seed=3)
    tree_ref = reference_for_batch(sb.q, sb.layer, sb.fb)
    sb.fb.custom_mask = None
    assert rel_err(reference_for_batch(sb.q, sb.layer, sb.fb), tree_ref) > 1e-2


# ---- the CUDA-graph planning, without a graph --------------------------------------------------------
def capture_batch(sb, bs: int, q: int, mask_buffer: torch.Tensor | None) -> ForwardBatch:
    """What the graph runner captures with: every request on the padding row (row 0, all slot 0), q tokens."""
    z = torch.zeros(bs * q, dtype=torch.int64, device=DEVICE)
    return ForwardBatch(
        mode=ForwardMode.TARGET_VERIFY, req_pool_indices=torch.zeros(bs, dtype=torch.int64, device=DEVICE),
        seq_lens=torch.full((bs,), q, dtype=torch.int32, device=DEVICE),
        extend_lens=torch.full((bs,), q, dtype=torch.int32, device=DEVICE), positions=z, out_cache_loc=z,
        req_to_token=sb.fb.req_to_token, pool=sb.pool, custom_mask=mask_buffer)


def graph_step(sb, backend, fb, meta):
    return backend.forward_extend(sb.q, sb.k, sb.v, sb.layer, fb, meta)


@pytest.mark.parametrize("mla,page_size,tree", [(False, 1, True), (False, 16, False), (True, 16, True),
                                                (True, 1, False)])
def test_graph_plan_replays_other_lengths_in_place(mla, page_size, tree):
    q, bs = 4, 3
    sb, compact = verify_batch([2, 19, 33], q, tree, page_size, mla, seed=5)
    backend = backend_for_pool("triton", sb.pool)
    backend.init_graph_buffers(bs, bs)
    mask_buffer = torch.ones(bs, q, q, dtype=torch.bool, device=DEVICE).tril() if tree else None  # [bs, q, q]
    cap = capture_batch(sb, bs, q, mask_buffer)
    meta = backend.plan_for_capture(cap)
    graph_step(sb, backend, cap, meta)  # what a capture records: the tile list is built here, once
    captured = meta.extend
    tiles = dict(captured.tiles)
    addresses = (captured.meta.qo_indptr.data_ptr(), captured.meta.kv_indptr.data_ptr(),
                 captured.meta.kv_indices.data_ptr(), captured.seq_lens.data_ptr())

    full = sb.fb.custom_mask
    replay = sb.fb
    if tree:
        mask_buffer.copy_(compact)
        replay.custom_mask = mask_buffer
    meta = backend.plan_for_replay(replay)
    plan = meta.extend
    assert plan is captured and plan.tiles == tiles
    assert (plan.meta.qo_indptr.data_ptr(), plan.meta.kv_indptr.data_ptr(), plan.meta.kv_indices.data_ptr(),
            plan.seq_lens.data_ptr()) == addresses
    out = graph_step(sb, backend, replay, meta)
    replay.custom_mask = full
    ref = reference_for_batch(sb.q, sb.layer, replay)
    assert rel_err(out, ref) < tolerance()
    if mla:
        assert meta.extend_path.startswith("mla tiles")
        assert not backend.expanded_prefill_applies(replay, meta)
    else:
        assert meta.extend_path.startswith("paged")

    if tree:  # a mask held elsewhere is copied into the captured buffer
        mask_buffer.zero_()
        replay.custom_mask = compact.to(DEVICE)
        meta = backend.plan_for_replay(replay)
        assert torch.equal(mask_buffer, compact.to(DEVICE))
        assert rel_err(graph_step(sb, backend, replay, meta), ref) < tolerance()


def test_graph_plan_refuses_what_was_not_captured():
    sb, _ = verify_batch([2, 7], 3, False, 1, False)
    backend = backend_for_pool("triton", sb.pool)
    backend.init_graph_buffers(2, 2)
    backend.plan_for_capture(capture_batch(sb, 2, 3, None))
    tree = torch.ones(2, 3, 3, dtype=torch.bool, device=DEVICE).tril()
    with pytest.raises(ValueError, match="never captured"):
        backend.plan_for_replay(capture_batch(sb, 2, 3, tree))  # a tree where only a chain was captured
    ragged = ForwardBatch.from_lengths(ForwardMode.TARGET_VERIFY, [1, 2], [2, 5], [3, 2], sb.fb.req_to_token,
                                       sb.pool)
    with pytest.raises(ValueError, match="as many tokens"):
        backend.plan_for_replay(ragged)
