"""A tree verify step's attention against the float64 oracle: random draft trees, the engine's own
masks (`verify_masks`), MHA and MLA pools, torch_native and triton (interpreted on the CPU)."""

from __future__ import annotations

import random

import pytest
import torch
from attention_helpers import poison_unused_slots, rel_err, run_layer

from attnserve.batch import ForwardMode
from attnserve.choice.registry import backend_for_pool
from attnserve.engine.speculative import DraftTree
from attnserve.engine.speculative.draft_tree import verify_masks
from attnserve.reference.attention import reference_for_batch
from attnserve.reference.synthetic import make_batch
from attnserve.transfers import to_device


def random_tree(rng: random.Random, n: int) -> DraftTree:
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    return DraftTree(tuple(rng.randrange(100) for _ in range(n)), tuple(parents))


BACKENDS = ["torch_native", "triton"]  # triton: interpreted on the CPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_tree_verify_matches_oracle(backend, mla, page_size):
    rng = random.Random(page_size + 2 * mla)
    prefix, drafts = [21, 6, 40], [5, 2, 6]  # each request verifies as many drafts as it has
    trees = [random_tree(rng, k) for k in drafts]
    assert not all(t.is_chain for t in trees)
    kw = {"num_heads": 4, "mla": (32, 16)} if mla else {"num_heads": 4, "num_kv_heads": 2, "head_dim": 32}
    sb = make_batch(prefix, [k + 1 for k in drafts], page_size=page_size, custom_mask=True,
                    mode=ForwardMode.TARGET_VERIFY, score_scale=1.0, seed=page_size, device=DEVICE,
                    dtype=torch.float32 if DEVICE == "cpu" else torch.bfloat16, **kw)
    _, flat = verify_masks(trees, prefix)
    sb.fb.custom_mask = to_device(flat, sb.fb.req_to_token.device)
    if not mla:
        poison_unused_slots(sb)
    out = run_layer(sb, backend_for_pool(backend, sb.pool))
    assert not out.isnan().any()
    ref = reference_for_batch(sb.q, sb.layer, sb.fb)
    err = rel_err(out, ref)
    assert err < (1e-4 if DEVICE == "cpu" else 2e-2)
    causal = reference_for_batch(sb.q, sb.layer, type(sb.fb)(**{**sb.fb.__dict__, "custom_mask": None}))
    assert rel_err(out, causal) > 10 * max(err, 1e-4)  # the tree mask changed what was attended, far past the error
