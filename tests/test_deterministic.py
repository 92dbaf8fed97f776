"""--enable-deterministic-inference on the embedded SmolLM2: greedy and seeded requests give the same tokens
alone, batched with copies of themselves or with other prompts, and with a warm prefix cache.

The kernels a run depends on are named where it can fail: the test ids say how the CPU multiplies bf16
(amx, avx512bf16, nobf16: the embedded model runs bf16 through oneDNN, or fp32 through BLAS without fast
bf16), and the assertion messages the weight format and rows per matmul call the engine ran, and the threads.
Mixed traffic, preemption and the matmul kernels alone: test_deterministic_soak.py.
"""

from __future__ import annotations

import pytest
import torch
from deterministic_helpers import conditions, cpu_bf16
from engine_helpers import prompts, tiny_llama

from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine
from attnserve.engine.llm import LLM
from attnserve.engine.sampling_params import SamplingParams

PROMPT = "def fibonacci(n):\n"
OTHERS = ["The capital of France is", "1, 2, 3,", "Once upon a time, in a land far away, there lived a",
          "Write a haiku about the sea.", "import numpy as np\n", "Q: What is 7 * 8?\nA:", "Hello"]
N = 24


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", max_total_tokens=4096, max_running_requests=16, enable_deterministic_inference=True)


@pytest.mark.needs_embedded_model
@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=N, temperature=0),
                                    SamplingParams(max_new_tokens=N, temperature=0.8, top_p=0.95, seed=7)],
                         ids=[f"greedy-{cpu_bf16()}", f"seeded-{cpu_bf16()}"])
def test_outputs_do_not_depend_on_the_batch_or_the_cache(llm, params):
    why = conditions(llm.engine)
    cold = llm.generate(PROMPT, params)[0].token_ids
    assert len(cold) == N or llm.generate(PROMPT, params)[0].finish_reason == "stop"
    warm = llm.generate(PROMPT, params)[0].token_ids  # the same prompt again: a prefix cache would serve it
    copies = [o.token_ids for o in llm.generate([PROMPT] * 8, params)]
    mixed = llm.generate([*OTHERS[:3], PROMPT, *OTHERS[3:]], params)[3].token_ids  # other lengths around it
    assert warm == cold, f"warm differs from cold [{why}]"
    differ = [i for i, c in enumerate(copies) if c != cold]
    assert not differ, f"copies {differ} of 8 in one batch differ from the request alone [{why}]"
    assert mixed == cold, f"the request among 7 other prompts differs from it alone [{why}]"
    assert llm.engine.pages_leaked() == 0


def _logits_of(engine, target: list[int], others: list[list[int]], params: SamplingParams) -> list[torch.Tensor]:
    """The logits row of the request for `target` at each step, run with `others` in the same batch."""
    rows: list[torch.Tensor] = []
    forward = engine.runner.forward

    def spy(batch):
        logits = forward(batch)
        sampling = [r for r, s in zip(batch.reqs, batch.sample) if s]
        rows.extend(logits[i].clone() for i, r in enumerate(sampling) if r.rid == req.rid)
        return logits

    engine.runner.forward = spy
    try:
        req = engine.add_request(target, params)
        for p in others:
            engine.add_request(p, params)
        engine.run_until_done()
    finally:
        engine.runner.forward = forward
    return rows


def test_fp32_logits_are_bitwise_the_same_alone_and_in_a_batch():
    """On the fp32 path (a CPU without fast bf16) too: BLAS picks its kernel by the row count."""
    # its own model: the deterministic weight format is set on the model, which other tests' engines share
    engine = Engine(EngineConfig(device="cpu", max_total_tokens=4096, chunked_prefill_size=None,
                                 attention_backend="torch_native", enable_deterministic_inference=True,
                                 disable_overlap_schedule=True), loaded=tiny_llama())
    target, *others = prompts(8, seed=5)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    alone = _logits_of(engine, target, [], params)
    batched = _logits_of(engine, target, others, params)
    assert len(alone) == len(batched) == 6
    assert all(torch.equal(a, b) for a, b in zip(alone, batched)), conditions(engine)
    assert engine.pages_leaked() == 0


def test_a_shared_model_is_not_switched_to_the_deterministic_format_under_another_engine():
    """The weight format lives on the model: an engine of the other mode must load its own copy."""
    bundle = tiny_llama()
    settings = {"device": "cpu", "max_total_tokens": 1024, "attention_backend": "torch_native"}
    Engine(EngineConfig(**settings), loaded=bundle)
    with pytest.raises(ValueError, match="deterministic"):
        Engine(EngineConfig(**settings, enable_deterministic_inference=True), loaded=bundle)


def test_speculative_decoding_is_refused():
    """Whether a step verifies depends on the other requests (prompts waiting, free pages): no promise."""
    with pytest.raises(ValueError, match="speculative decoding cannot run with enable_deterministic_inference"):
        EngineConfig(enable_deterministic_inference=True, speculative_algorithm="ngram")


def test_the_config_says_what_the_mode_turns_off():
    """The start-up log and /server_info read these: no chunking, no prefix cache."""
    config = EngineConfig(enable_deterministic_inference=True)
    assert config.chunked_prefill_size is None and config.disable_radix_cache
    assert EngineConfig().chunked_prefill_size == 2048 and not EngineConfig().disable_radix_cache
