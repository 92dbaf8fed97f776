"""Verify CUDA graphs through the runner: padded replays give the eager verify step's logits.

On the CPU the runner's recording step is replaced by one that re-runs the captured call on the same fixed
buffers (what a graph replay computes), with the triton backend under TRITON_INTERPRET=1; everything else
(buffers, padding, the backend's capture / replay planning, the compact tree mask) is the real code. On a GPU
(marked gpu) real graphs are captured and replayed.
"""

import pytest
import torch
from attention_helpers import rel_err
from engine_helpers import VOCAB, tiny_model

from attnserve.attention.layer import attention_step
from attnserve.batch import ForwardBatch, ForwardMode
from attnserve.choice.registry import backend_for_pool
from attnserve.engine.cuda_graph import CudaGraphRunner, GraphBuffers, verify_batch_sizes
from attnserve.kvcache.pool import ReqToTokenPool, make_pool

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
Q = 4  # tokens a request per verify step: its last token and 3 drafts


class Rerun:
    """Stands in for torch.cuda.CUDAGraph: replay() recomputes the captured call into its output, over the step
    metadata the capture ran with (a real graph holds its kernels; a rerun goes through the layers again)."""

    def __init__(self, run, out):
        self.run, self.out = run, out

    def replay(self):
        self.out.copy_(self.run())


class CpuRecordingRunner(CudaGraphRunner):
    def _record(self, run):
        out = run()  # also the warm-up: the backend builds its tile lists here, as before a real capture
        return Rerun(run, out), out


def test_verify_batch_sizes_fit_the_token_budget():
    sizes = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert verify_batch_sizes(sizes, 5, max_tokens=1024) == sizes
    assert verify_batch_sizes(sizes, 9, max_tokens=256) == [1, 2, 4, 8, 16, 24]
    assert verify_batch_sizes([4, 8], 9, max_tokens=16) == [4]  # the smallest decode size at least


def test_fill_points_padded_requests_at_the_padding_row():
    buf = GraphBuffers.allocate(4, 3, padding_row=7, device="cpu")
    ids = torch.arange(1, 7)  # [2 * 3]
    tree = torch.ones(2, 3, 3, dtype=torch.bool).tril()
    tree[1, 2, 1] = False
    buf.input_ids.fill_(-1)
    buf.out_cache_loc.fill_(99)
    buf.fill(2, 4, 7, ids, ids + 10, ids + 100, torch.tensor([3, 5]), torch.tensor([20, 9], dtype=torch.int32),
             tree)
    assert buf.input_ids.tolist() == [1, 2, 3, 4, 5, 6] + [0] * 6
    assert buf.out_cache_loc.tolist() == [101, 102, 103, 104, 105, 106] + [0] * 6  # slot 0: the padding page
    assert buf.req_pool_indices.tolist() == [3, 5, 7, 7]
    assert buf.seq_lens.tolist() == [20, 9, 3, 3]  # a padded request holds its q tokens and nothing else
    assert torch.equal(buf.tree_mask[:2], tree)
    buf.pad_all(7)  # before a capture: no request of an earlier replay stays
    assert buf.req_pool_indices.tolist() == [7] * 4 and buf.seq_lens.tolist() == [3] * 4
    assert not buf.out_cache_loc.any() and not buf.input_ids.any()


def _model(device, dtype):
    return tiny_model({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }, seed=1, dtype=dtype, device=device, matrix_std=None).model


def _scenario(device, dtype, page_size, prefix_lens, runner_cls, graph_sizes):
    """A model, a pool whose requests hold random prefixes, a triton backend and a captured runner."""
    model = _model(device, dtype)
    spec = model.kv_cache_spec()
    pages_per_req = -(-(max(prefix_lens) + Q) // page_size)
    pool = make_pool(spec, 2 + len(prefix_lens) * pages_per_req, page_size, dtype=dtype, device=device)
    req_pool = ReqToTokenPool(len(prefix_lens) + 2, pages_per_req * page_size, device=device)
    padding_row = req_pool.alloc()
    g = torch.Generator().manual_seed(0)
    pages = (torch.randperm(len(prefix_lens) * pages_per_req, generator=g) + 1).view(len(prefix_lens), -1)
    rows = []
    for i, p in enumerate(prefix_lens):
        row = req_pool.alloc()
        slots = pool.slots_of_pages(pages[i].tolist())[: p + Q]
        req_pool.req_to_token[row, : p + Q] = slots.to(torch.int32).to(device)
        for layer in range(spec.num_layers):  # the prefix's K/V, as earlier steps would have written it
            k = torch.randn(p, spec.num_kv_heads, spec.head_dim, generator=g).to(device, dtype)
            pool.store(layer, slots[:p].to(device), k, torch.randn(k.shape, generator=g).to(device, dtype))
        rows.append(row)
    backend = backend_for_pool("triton", pool)
    runner = runner_cls(model, backend, pool, req_pool, padding_row, graph_sizes, torch.device(device))
    runner.capture()
    return model, pool, req_pool, backend, runner, rows


def _tree_masks(bs: int, gen) -> torch.Tensor:
    """bool `[bs, Q, Q]`, ancestor-or-self of random trees (token 0 the root)."""
    m = torch.zeros(bs, Q, Q, dtype=torch.bool)
    for b in range(bs):
        for i in range(Q):
            m[b, i, i] = True
            if i:
                m[b, i] |= m[b, int(torch.randint(0, i, (1,), generator=gen))]
    return m


def _step(model, pool, req_pool, backend, rows, prefix_lens, tree: bool, seed: int):
    """One verify step's inputs and its eager logits (the contract's full mask, planned by plan())."""
    device = pool.device
    g = torch.Generator().manual_seed(seed)
    bs = len(rows)
    compact = _tree_masks(bs, g) if tree else None
    depth = compact.sum(-1) - 1 if tree else torch.arange(Q).expand(bs, Q)  # [bs, Q]
    ids = torch.randint(0, VOCAB, (bs * Q,), generator=g).to(device)
    positions = (torch.tensor(prefix_lens)[:, None] + depth).reshape(-1).to(device)  # kv_len + depth
    full = None
    if tree:
        full = torch.cat([torch.cat([torch.ones(Q, p, dtype=torch.bool), m], 1).reshape(-1)
                          for m, p in zip(compact, prefix_lens)]).to(device)
    fb = ForwardBatch.from_lengths(ForwardMode.TARGET_VERIFY, rows, prefix_lens, [Q] * bs, req_pool.req_to_token,
                                   pool, custom_mask=full)
    fb.positions = positions
    with torch.inference_mode(), attention_step(backend, backend.plan(fb)):
        eager = model(ids, positions, fb)  # [bs * Q, vocab]
    mask = compact.to(device) if tree else None
    return (ids, positions, fb.out_cache_loc, fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu, Q, mask), eager


def _kv(pool):
    return torch.stack([torch.stack([pool.k_buffer[i], pool.v_buffer[i]]) for i in range(len(pool.k_buffer))])


def _check_replays(scenario, prefix_lens, batches, tol, same_argmax: bool):
    model, pool, req_pool, backend, runner, rows = scenario
    for tree in (False, True):
        runner.capture_verify(Q, tree)
        assert runner.can_run(len(rows), Q, tree) and not runner.can_run(len(rows), Q + 1, tree)
        for n in batches:
            args, eager = _step(model, pool, req_pool, backend, rows[:n], prefix_lens[:n], tree, seed=n + 10 * tree)
            before = _kv(pool)
            logits = runner.replay(*args)
            assert logits.shape == eager.shape
            assert rel_err(logits, eager) < tol
            if same_argmax:  # float32; bf16 logits tie too often for a padded batch's GEMMs to keep every argmax
                assert torch.equal(logits.argmax(-1), eager.argmax(-1))
            # besides the real requests' new slots (rewritten with the same K/V), only the padding page changed
            changed = (_kv(pool) != before).flatten(0, 1).flatten(2).any(-1).any(0).nonzero().flatten()
            assert set(changed.tolist()) <= set(args[2].tolist()) | set(range(pool.page_size))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in of test_gpu_graphed_verify_matches_eager, "
                    "which runs on a GPU instead")
def test_cpu_padded_verify_replays_match_eager():
    prefix_lens = [5, 23, 12]  # pages of 16: page size 1 is covered by tests/test_verify_attention.py
    scenario = _scenario("cpu", torch.float32, 16, prefix_lens, CpuRecordingRunner, [1, 4])
    _check_replays(scenario, prefix_lens, [3, 1], tol=1e-4, same_argmax=True)  # 3 requests replay the graph of 4


@gpu
@needs_cuda
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_graphed_verify_matches_eager(page_size):
    prefix_lens = [700, 33, 129, 1, 260, 64, 5]
    scenario = _scenario("cuda", torch.bfloat16, page_size, prefix_lens, CudaGraphRunner, [1, 2, 4, 8])
    _check_replays(scenario, prefix_lens, [7, 3, 1, 4], tol=2e-2, same_argmax=False)


class RecordingRunner:
    """What start-up asks of a graph runner's verify side: which graphs, and what it says when one fails."""

    def __init__(self, refuse_trees: bool):
        self.refuse_trees, self.captured = refuse_trees, []

    def capture_verify(self, q, tree, sizes):
        if tree and self.refuse_trees:
            raise ValueError("no tree graphs here")
        self.captured.append((q, tree, sizes))
        return 0.5


def test_startup_captures_chain_and_tree_verify_graphs_for_the_configured_drafts():
    from types import SimpleNamespace

    from attnserve.engine.startup import _capture_verify_graphs

    runner = RecordingRunner(refuse_trees=False)
    config = SimpleNamespace(speculative_num_draft_tokens=4, speculative_eagle_topk=2)
    note = _capture_verify_graphs(config, runner, [1, 2, 4, 8])
    assert runner.captured == [(5, False, [1, 2, 4, 8]), (5, True, [1, 2, 4, 8])]
    assert "verify 5 tokens" in note and "tree captured" in note

    runner = RecordingRunner(refuse_trees=True)
    note = _capture_verify_graphs(config, runner, [1, 2])
    assert runner.captured == [(5, False, [1, 2])]
    assert "tree eager (no tree graphs here)" in note

    runner = RecordingRunner(refuse_trees=False)  # a chain drafter: no tree graphs to capture
    _capture_verify_graphs(SimpleNamespace(speculative_num_draft_tokens=2, speculative_eagle_topk=1), runner, [1])
    assert runner.captured == [(3, False, [1])]
