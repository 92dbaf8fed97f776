"""Expanded MLA prefill as a declared capability: the layer and the hybrid route it, only where declared.

A stand-in backend (torch_native plus an expanded path in plain PyTorch) declares the feature; a tiny
DeepSeek model then runs its fresh prompts expanded, alone and as a hybrid's prefill side, with the
same logits as the absorbed path, and the latent rows it stores serve the decode step that follows.
"""

import dataclasses

import pytest
import torch
from engine_helpers import TINY_DEEPSEEK, VOCAB, tiny_model

from attnserve.attention.backends.torch_native import TorchNativeBackend
from attnserve.attention.base import AttentionBackend
from attnserve.attention.hybrid import HybridAttentionBackend
from attnserve.attention.layer import AttentionLayer, attention_step
from attnserve.batch import ForwardBatch, ForwardMode
from attnserve.kvcache.pool import make_pool
from attnserve.reference.attention import attend


class Expanded(TorchNativeBackend):
    """torch_native plus an expanded MLA prefill for fresh prompts, each call noted."""

    features = dataclasses.replace(TorchNativeBackend.features, expanded_mla_prefill=True)

    def __init__(self, pool):
        super().__init__(pool)
        self.calls = []

    def expanded_prefill_applies(self, fb, meta):
        return fb.custom_mask is None and not any(fb.prefix_lens_cpu)

    def forward_expanded_prefill(self, q, k, v, layer, fb, meta):
        self.calls.append((layer.layer_id, fb.extend_lens_cpu))
        out, start = [], 0
        for n in fb.extend_lens_cpu:
            pos = torch.arange(n)
            mask = pos[None, :] <= pos[:, None]  # [n, n] causal within the request
            s = slice(start, start + n)
            out.append(attend(q[s].double(), k[s].double(), v[s].double(), mask, layer.scaling).to(q.dtype))
            start += n
        return torch.cat(out)  # [T, H, v]


class Undeclared(Expanded):
    """Answers yes but does not declare the feature: the layer must never hand it the expanded path."""

    features = TorchNativeBackend.features


def _steps(model, make_backend, prompts):
    """One fresh-prompt extend step, then one decode step: (extend logits, decode logits, the backend)."""
    page_size = 4
    lengths = [len(p) + 1 for p in prompts]
    pages = [-(-n // page_size) for n in lengths]
    pool = make_pool(model.kv_cache_spec(), sum(pages) + 1, page_size, dtype=torch.float32)
    req_to_token = torch.zeros(len(prompts), max(lengths), dtype=torch.int32)  # [B, max_len]
    first = 1
    for row, (n, p) in enumerate(zip(lengths, pages)):
        req_to_token[row, :n] = pool.slots_of_pages(list(range(first, first + p)))[:n].to(torch.int32)
        first += p
    backend = make_backend(pool)
    rows = list(range(len(prompts)))
    with torch.no_grad():
        fb = ForwardBatch.from_lengths(ForwardMode.EXTEND, rows, [0] * len(rows), [len(p) for p in prompts],
                                       req_to_token, pool)
        ids = torch.tensor([t for p in prompts for t in p])  # [T]
        with attention_step(backend, backend.plan(fb)):
            extend = model(ids, fb.positions, fb, logits_indices=None)  # [T, vocab]
        fb = ForwardBatch.from_lengths(ForwardMode.DECODE, rows, [len(p) for p in prompts], [1] * len(rows),
                                       req_to_token, pool)
        with attention_step(backend, backend.plan(fb)):
            decode = model(extend.view(-1, VOCAB)[torch.tensor([len(p) for p in prompts]).cumsum(0) - 1].argmax(-1),
                           fb.positions, fb)  # [B, vocab]
    return extend, decode, backend


@pytest.fixture(scope="module")
def deepseek():
    model = tiny_model(TINY_DEEPSEEK, seed=3).model
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (11, 23, 5)]
    return model, prompts, _steps(model, TorchNativeBackend, prompts)


def _close(a, b):
    return ((a - b).norm() / b.norm()).item() < 1e-4


def test_deepseek_runs_fresh_prompts_expanded_where_the_backend_declares_it(deepseek):
    model, prompts, (ref_extend, ref_decode, _) = deepseek
    extend, decode, backend = _steps(model, Expanded, prompts)
    assert backend.calls == [(0, [11, 23, 5]), (1, [11, 23, 5])]  # both layers, the extend step only
    assert _close(extend, ref_extend) and _close(decode, ref_decode)  # decode read the stored latent rows


def test_the_hybrid_hands_expanded_prefill_to_its_prefill_backend(deepseek):
    model, prompts, (ref_extend, ref_decode, _) = deepseek
    sides = {}

    def hybrid(pool):
        sides["prefill"], sides["decode"] = Expanded(pool), Undeclared(pool)
        return HybridAttentionBackend(sides["prefill"], sides["decode"])

    extend, decode, backend = _steps(model, hybrid, prompts)
    assert backend.features.expanded_mla_prefill
    assert [layer for layer, _ in sides["prefill"].calls] == [0, 1] and sides["decode"].calls == []
    assert _close(extend, ref_extend) and _close(decode, ref_decode)


def test_a_backend_that_does_not_declare_it_never_gets_it(deepseek):
    model, prompts, (ref_extend, _, _) = deepseek
    extend, _, backend = _steps(model, Undeclared, prompts)
    assert backend.calls == [] and _close(extend, ref_extend)

    def hybrid(pool):  # the prefill side decides, whatever the decode side declares
        return HybridAttentionBackend(Undeclared(pool), Expanded(pool))

    _, _, backend = _steps(model, hybrid, prompts)
    assert not backend.features.expanded_mla_prefill
    assert backend.prefill_backend.calls == [] and backend.decode_backend.calls == []


def test_the_layer_refuses_expanded_prefill_without_the_feature():
    layer = AttentionLayer(0, 4, 1, 48, v_head_dim=32, is_mla=True)
    pool = make_pool(tiny_model(TINY_DEEPSEEK).model.kv_cache_spec(), 4, 4, dtype=torch.float32)
    fb = ForwardBatch.from_lengths(ForwardMode.EXTEND, [0], [0], [3], torch.arange(8, dtype=torch.int32)[None],
                                   pool)
    q = torch.zeros(3, 4, 32)
    undeclared = Undeclared(pool)
    with attention_step(undeclared, undeclared.plan(fb)):
        assert not layer.expanded_prefill_applies(fb)
        with pytest.raises(ValueError, match="does not declare expanded MLA prefill"):
            layer.forward_expanded(q, q, q[..., :16], torch.zeros(3, 1, 48), fb)
    mha = AttentionLayer(0, 4, 4, 32)
    expanded = Expanded(pool)
    with attention_step(expanded, expanded.plan(fb)):
        assert layer.expanded_prefill_applies(fb) and not mha.expanded_prefill_applies(fb)
    with pytest.raises(ValueError, match="no attention backend for this step"):  # outside any: said plainly
        layer.expanded_prefill_applies(fb)


def test_the_base_backend_neither_applies_nor_runs_it():
    class Plain(AttentionBackend):
        name = "plain"

        def plan(self, fb):
            return None

        def forward_extend(self, q, k, v, layer, fb, meta):
            raise AssertionError

        def forward_decode(self, q, layer, fb, meta):
            raise AssertionError

    backend = Plain(None)
    assert not backend.features.expanded_mla_prefill and not backend.expanded_prefill_applies(None, None)
    with pytest.raises(NotImplementedError, match="backend plain has no expanded MLA prefill"):
        backend.forward_expanded_prefill(None, None, None, None, None, None)
