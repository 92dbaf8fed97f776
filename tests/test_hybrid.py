"""The hybrid backend routes each step by forward mode; results match the oracle on the CPU."""

import dataclasses
import warnings

import pytest

from attnserve.attention.backends.flex import FlexAttentionBackend
from attnserve.attention.backends.torch_native import TorchNativeBackend
from attnserve.attention.base import AttentionBackend, AttentionRequirements, BackendFeatures, unsupported
from attnserve.attention.hybrid import (
    COMBINE_BOTH_SIDES,
    ONE_SIDE,
    HybridAttentionBackend,
    hybrid_features,
)
from attnserve.batch import ForwardMode
from attnserve.choice.registry import build_backend, get_spec
from attnserve.choice.selection import select_backends
from attnserve.hardware import PRESET_HARDWARE
from attnserve.reference.attention import reference_for_batch
from attnserve.reference.synthetic import make_batch
from attnserve.shape import GENERIC_GQA


class Recording(TorchNativeBackend):
    """torch_native that notes every call, so routing is visible."""

    def __init__(self, pool, tag):
        super().__init__(pool)
        self.tag = tag
        self.calls = []

    def plan(self, fb):
        self.calls.append(("plan", fb.mode))
        return super().plan(fb)

    def forward(self, q, k, v, layer, fb, meta):
        self.calls.append(("forward", fb.mode))
        return super().forward(q, k, v, layer, fb, meta)

    def store_kv(self, layer, fb, k, v):
        self.calls.append(("store", fb.mode))
        super().store_kv(layer, fb, k, v)

    def init_graph_buffers(self, max_bs, max_tokens):
        self.calls.append(("init_graph", max_bs))

    def plan_for_capture(self, fb):
        self.calls.append(("capture", fb.mode))

    def plan_for_replay(self, fb):
        self.calls.append(("replay", fb.mode))


def _pair(pool, mode="prefill"):
    p, d = Recording(pool, "prefill"), Recording(pool, "decode")
    return p, d, HybridAttentionBackend(p, d, speculative_attention_mode=mode)


ROUTES = [
    (ForwardMode.EXTEND, "prefill", "prefill"),
    (ForwardMode.MIXED, "prefill", "prefill"),
    (ForwardMode.DECODE, "prefill", "decode"),
    (ForwardMode.IDLE, "prefill", "decode"),
    (ForwardMode.TARGET_VERIFY, "prefill", "prefill"),
    (ForwardMode.TARGET_VERIFY, "decode", "decode"),
]


@pytest.mark.parametrize("mode,spec_mode,expected", ROUTES)
def test_routes_by_forward_mode(mode, spec_mode, expected):
    sb = make_batch([5, 9], [3, 2] if mode is not ForwardMode.DECODE else [1, 1], mode=mode)
    p, d, hybrid = _pair(sb.pool, spec_mode)
    assert hybrid.backend_for(mode).tag == expected
    meta = hybrid.plan(sb.fb)
    hybrid.store_kv(sb.layer, sb.fb, sb.k, sb.v)
    hybrid.forward(sb.q, sb.k, sb.v, sb.layer, sb.fb, meta)
    chosen, other = (p, d) if expected == "prefill" else (d, p)
    assert [c[0] for c in chosen.calls] == ["plan", "store", "forward"]
    assert other.calls == []


def test_decode_graphs_go_to_the_decode_backend():
    sb = make_batch([5, 9], [1, 1])
    p, d, hybrid = _pair(sb.pool)
    hybrid.init_graph_buffers(8, 8)
    hybrid.plan_for_capture(sb.fb)
    hybrid.plan_for_replay(sb.fb)
    assert d.calls == [("init_graph", 8), ("capture", ForwardMode.DECODE), ("replay", ForwardMode.DECODE)]
    assert p.calls == []  # torch_native can't be captured, so no verify graph buffers either


def test_features_combine_both_sides():
    sb = make_batch([5], [1])
    hybrid = HybridAttentionBackend(TorchNativeBackend(sb.pool), FlexAttentionBackend(sb.pool))
    assert not hybrid.features.cuda_graph
    assert hybrid.name == "hybrid(prefill=torch_native, decode=flex_attention)"
    tn, flex = TorchNativeBackend.features, FlexAttentionBackend.features
    assert "MLA" in tn.attention_types and hybrid.features.attention_types == flex.attention_types
    assert hybrid.features.kv_dtypes == tn.kv_dtypes & flex.kv_dtypes != tn.kv_dtypes
    assert hybrid.features.devices == frozenset({"cpu", "cuda"})  # torch_native's mps is not flex's


def test_hybrid_claims_only_what_both_sides_support():
    """FlashInfer prefill + Triton decode: Triton runs sinks, FlashInfer does not, so the pair does not."""
    fi, tr = get_spec("flashinfer").features, get_spec("triton").features
    both = hybrid_features(fi, tr, verify=fi)
    assert tr.attention_sinks and not fi.attention_sinks and not both.attention_sinks
    assert unsupported(both, AttentionRequirements(attention_sinks=True)) == ["no attention sinks"]
    assert both.head_dims == tuple(d for d in fi.head_dims if d in tr.head_dims)
    assert both.kv_dtypes == fi.kv_dtypes & tr.kv_dtypes
    assert both.required_packages == ("flashinfer", "triton") and both.min_compute_capability == (8, 0)
    assert (both.cuda_graph, both.custom_mask) == (tr.cuda_graph, fi.custom_mask)  # decode graphs; verify masks


def test_hybrid_features_per_feature_rules():
    prefill_only = BackendFeatures(page_sizes=(16, 32), decode=False, cuda_graph=False, custom_mask=True,
                                   min_compute_capability=(9, 0), compute_capabilities=None, deterministic=True)
    decode_only = BackendFeatures(page_sizes=(32, 64), prefill=False, cuda_graph=True, custom_mask=False,
                                  min_compute_capability=(8, 0), compute_capabilities=(9, 10))
    f = hybrid_features(prefill_only, decode_only, verify=decode_only)
    assert (f.prefill, f.decode, f.cuda_graph, f.custom_mask) == (True, True, True, False)
    assert f.page_sizes == (32,) and f.compute_capabilities == (9, 10) and f.min_compute_capability == (9, 0)
    assert not f.deterministic
    assert hybrid_features(prefill_only, decode_only, verify=prefill_only).custom_mask
    assert hybrid_features(BackendFeatures(), BackendFeatures(), BackendFeatures()) == BackendFeatures()
    assert set(COMBINE_BOTH_SIDES) | set(ONE_SIDE) == {f.name for f in dataclasses.fields(BackendFeatures)}


def test_bad_arguments():
    a = make_batch([5], [1])
    b = make_batch([5], [1])
    with pytest.raises(ValueError, match="speculative_attention_mode"):
        HybridAttentionBackend(TorchNativeBackend(a.pool), TorchNativeBackend(a.pool), "verify")
    with pytest.raises(ValueError, match="one KV pool"):
        HybridAttentionBackend(TorchNativeBackend(a.pool), TorchNativeBackend(b.pool))


@pytest.mark.parametrize("prefix,ext", [([7, 0, 30], [5, 12, 2]), ([11, 4, 25], [1, 1, 1])])
def test_hybrid_torch_native_prefill_flex_decode_matches_oracle(prefix, ext):
    sb = make_batch(prefix, ext, page_size=4, score_scale=20.0, sliding_window=9)
    hybrid = HybridAttentionBackend(TorchNativeBackend(sb.pool), FlexAttentionBackend(sb.pool))
    meta = hybrid.plan(sb.fb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = hybrid.forward(sb.q, sb.k, sb.v, sb.layer, sb.fb, meta)
    ref = reference_for_batch(sb.q, sb.layer, sb.fb)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_build_backend_from_a_selection():
    sb = make_batch([5], [1])
    cpu = PRESET_HARDWARE["cpu"]
    one = build_backend(select_backends(cpu, GENERIC_GQA), sb.pool, cpu)
    assert isinstance(one, TorchNativeBackend)
    sel = select_backends(cpu, GENERIC_GQA, prefill_backend="torch_native", decode_backend="flex_attention")
    two = build_backend(sel, sb.pool, cpu, speculative_attention_mode="decode")
    assert isinstance(two, HybridAttentionBackend) and isinstance(two, AttentionBackend)
    assert isinstance(two.decode_backend, FlexAttentionBackend)
    assert two.backend_for(ForwardMode.TARGET_VERIFY) is two.decode_backend
