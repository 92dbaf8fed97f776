"""Deterministic inference under mixed traffic: each request's logits are, bit for bit, those it gets alone.

Distinct prompts of different lengths, greedy and seeded (top-p; top-k with min-p), arrive over several
steps, so a request shares its steps with different requests, at different places in the batch and with
different row counts; one request is aborted on the way, and a small KV pool preempts some. Each request
is then run alone in a fresh engine: its logits at every sampled step must be the same bits, and so its
tokens. Tiny random-weight Llamas (fp32, BLAS) at page sizes 1, 2 and 4, one wide enough that BLAS changes
its kernel with the row count, and the embedded SmolLM2 (bf16 from Q4 weights: the int4 + oneDNN path,
AMX where the CPU has it). flex_attention cannot keep the promise and is refused.
"""

from __future__ import annotations

import random

import pytest
import torch
from deterministic_helpers import Work, assert_each_as_alone, cpu_bf16
from engine_helpers import VOCAB, tiny_llama, tiny_model

from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine
from attnserve.engine.sampling_params import SamplingParams
from attnserve.models.cpu_weights import (
    DETERMINISTIC_INT4_ROW_BLOCK,
    DETERMINISTIC_ROW_BLOCK,
    CPUMatmul,
    onednn_has_bf16,
    pack_int4,
    prepack_dense,
    rows_are_independent,
)
from attnserve.models.q4_blocks import Q4Codes

GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)


def _seeded(seed: int, n: int = 10) -> SamplingParams:
    if seed % 2:
        return SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.8, top_p=0.95, seed=seed)
    return SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=1.0, top_k=40, min_p=0.05, seed=seed)


def _traffic(vocab: int, n: int = 8, seed: int = 0, new_tokens: int = 10) -> list[Work]:
    """n distinct prompts (3 to 70 tokens), half greedy, arriving over the first steps; one aborted."""
    rng = random.Random(seed)
    lengths = [3, 70, 17, 41, 9, 55, 26, 33][:n]
    arrivals = [0, 0, 0, 1, 2, 2, 4, 7][:n]
    work = []
    for j, (length, arrival) in enumerate(zip(lengths, arrivals)):
        prompt = [rng.randrange(vocab) for _ in range(length)]
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True) if j % 2 == 0 else _seeded(100 + j,
                                                                                                     new_tokens)
        work.append(Work(prompt, params, arrival, abort_at=5 if j == 4 else None))
    return work


def _settings(**overrides) -> dict:
    settings = {"device": "cpu", "max_total_tokens": 2048, "max_running_requests": 16,
                "attention_backend": "torch_native", "enable_deterministic_inference": True}
    settings.update(overrides)
    return settings


_MODELS: dict[str, object] = {}


def _tiny(wide: bool = False):
    """Deterministic mode packs the model's weights its own way: these bundles serve deterministic engines only."""
    key = "wide" if wide else "narrow"
    if key not in _MODELS:
        # wide: SmolLM2's widths in fp32 (what a CPU without fast bf16 runs), two layers: with two threads MKL's
        # GEMM rounds a row of the 576 x 1536 down-projection differently from 63 rows on
        _MODELS[key] = tiny_model({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 576,
            "intermediate_size": 1536, "num_hidden_layers": 2, "num_attention_heads": 9, "num_key_value_heads": 3,
            "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": False}) if wide else tiny_llama()
    return _MODELS[key]


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_mixed_traffic_matches_each_request_alone_on_a_tiny_llama(page_size):
    assert_each_as_alone(_tiny(), _settings(page_size=page_size), _traffic(VOCAB, seed=page_size))


def test_mixed_traffic_matches_each_request_alone_where_blas_changes_kernel_with_the_rows():
    """SmolLM2's widths in fp32: the BLAS path of a CPU without fast bf16 (the embedded model's widths)."""
    assert_each_as_alone(_tiny(wide=True), _settings(page_size=2), _traffic(VOCAB, n=6, seed=7, new_tokens=6))


def test_preempted_requests_match_their_run_alone():
    """A request preempted for lack of KV pages is recomputed in the steps it first ran in (its prompt whole,
    then a token a step), so its rows meet the same attention shapes and round the same."""
    work = _traffic(VOCAB, seed=11, new_tokens=16)
    mixed = assert_each_as_alone(_tiny(), _settings(page_size=4, max_total_tokens=160), work)
    assert mixed.engine.scheduler.counters.preemptions > 0
    assert any(mixed.preempted[j] for j, w in enumerate(work) if w.abort_at is None)


def test_flex_attention_is_refused_and_the_default_is_invariant():
    """flex_attention sums over the pool's slots in slot order, which the other requests decide: no promise."""
    with pytest.raises(ValueError, match="no deterministic mode"):
        Engine(EngineConfig(**_settings(attention_backend="flex_attention")), loaded=_tiny())
    engine = Engine(EngineConfig(**_settings(attention_backend=None)), loaded=_tiny())
    assert engine.parts.attention.prefill_backend == engine.parts.attention.decode_backend == "torch_native"


@pytest.mark.needs_embedded_model
def test_mixed_traffic_matches_each_request_alone_on_the_embedded_model():
    """bf16 from the GGUF's Q4 weights: steps of more than 32 rows ran another oneDNN kernel on AMX CPUs, and a
    seeded row's probabilities were summed across threads when it was sampled alone."""
    from attnserve.models.loader import load_model

    bundle = load_model(None, device="cpu")
    work = _traffic(bundle.config.vocab_size, n=6, seed=3, new_tokens=6)
    work[4].abort_at = None
    mixed = assert_each_as_alone(bundle, _settings(max_running_requests=8), work)
    assert "oneDNN bf16" in mixed.engine.parts.model.weights_note or "BLAS" in mixed.engine.parts.model.weights_note


# ---- the matmul alone ------------------------------------------------------------------------------------
def _kernels() -> list:
    g = torch.Generator().manual_seed(0)
    n, k = 576, 1536
    w = torch.randn(n, k, generator=g) * 0.05
    codes = Q4Codes(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
                    torch.rand(n, k // 32, generator=g) * 0.01, torch.randn(n, k // 32, generator=g) * 0.01)
    out = [pytest.param(CPUMatmul(w, None, 0, torch.float32, DETERMINISTIC_ROW_BLOCK), torch.float32,
                        id="blas-fp32"),
           pytest.param(CPUMatmul(None, pack_int4(codes), 0, torch.bfloat16, DETERMINISTIC_INT4_ROW_BLOCK),
                        torch.bfloat16, id="int4")]
    if onednn_has_bf16():
        out.append(pytest.param(CPUMatmul(prepack_dense(w.bfloat16()), None, 0, torch.bfloat16,
                                          DETERMINISTIC_ROW_BLOCK), torch.bfloat16, id=f"onednn-bf16-{cpu_bf16()}"))
    return out


@pytest.mark.parametrize("mm, dtype", _kernels())
def test_a_row_gets_the_same_bits_from_every_cpu_kernel_in_any_batch(mm, dtype):
    """Row counts on both sides of each kernel's own switch points (BLAS's 1 and 64 rows, oneDNN's 32 on AMX),
    in the calls the start-up check settles on for this CPU: fixed blocks where a row's bits do not depend on
    its place in the call, else one row a call (a many-threaded BLAS can split a block's reduction by row)."""
    if not rows_are_independent(mm, 1536, dtype):
        mm.row_block = 1  # what make_batch_invariant does with such a kernel and shape
        assert rows_are_independent(mm, 1536, dtype), f"{mm.kernel}: one row a call still depends on the call"
    x = torch.randn(100, 1536, generator=torch.Generator().manual_seed(1)).to(dtype)  # [100, K]
    alone = torch.cat([mm(x[i : i + 1]) for i in range(100)])  # [100, N]
    for rows in (2, 5, 16, 17, 33, 64, 100):
        batch = mm(x[:rows])
        bad = [i for i in range(rows) if not torch.equal(batch[i], alone[i])]
        assert not bad, f"{mm.kernel} in {mm.row_block}-row calls, {rows} rows: rows {bad} differ from alone"


def test_a_kernel_whose_rows_depend_on_their_place_runs_one_row_a_call(monkeypatch, caplog):
    """The start-up check catches a kernel that rounds a row by its place in the call (as oneDNN's AMX kernel
    and MKL's threaded GEMM do above their switch points): that shape then runs one row a call, said in the log,
    and the promise still holds. A kernel that differs from itself on the same input is refused."""
    kernel = CPUMatmul._kernel

    def by_place(self, x, bias):  # odd rows of a call of several round otherwise
        y = kernel(self, x, bias)
        if x.shape[0] > 1:
            y = y.clone()
            y[1::2] = y[1::2] * (1 + 2**-20)
        return y

    monkeypatch.setattr(CPUMatmul, "_kernel", by_place)
    with caplog.at_level("WARNING", logger="attnserve.models"):
        bundle = tiny_llama(seed=1)
        engine = Engine(EngineConfig(**_settings()), loaded=bundle)
    assert "one row a call" in engine.parts.model.weights_note and "run one row a call" in caplog.text
    mms = [m.cpu_matmul for m in bundle.model.modules() if getattr(m, "cpu_matmul", None) is not None]
    assert mms and all(mm.row_block == 1 for mm in mms)
    assert_each_as_alone(bundle, _settings(), _traffic(VOCAB, n=4, seed=5, new_tokens=4))

    monkeypatch.setattr(CPUMatmul, "_kernel", lambda self, x, bias: kernel(self, x, bias) + torch.rand(()) * 1e-6)
    with pytest.raises(RuntimeError, match="different results for the same input"):
        Engine(EngineConfig(**_settings()), loaded=tiny_llama(seed=2))
