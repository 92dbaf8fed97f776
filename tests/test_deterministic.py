"""--enable-deterministic-inference on the embedded SmolLM2: greedy and seeded requests give the same tokens
alone, batched with copies of themselves or with other prompts, and with a warm prefix cache."""

from __future__ import annotations

import pytest

from attnserve.engine.llm import LLM
from attnserve.engine.sampling_params import SamplingParams

PROMPT = "def fibonacci(n):\n"
OTHERS = ["The capital of France is", "1, 2, 3,", "Once upon a time, in a land far away, there lived a",
          "Write a haiku about the sea.", "import numpy as np\n", "Q: What is 7 * 8?\nA:", "Hello"]
N = 24


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", max_total_tokens=4096, max_running_requests=16, enable_deterministic_inference=True)


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=N, temperature=0),
                                    SamplingParams(max_new_tokens=N, temperature=0.8, top_p=0.95, seed=7)],
                         ids=["greedy", "seeded"])
def test_outputs_do_not_depend_on_the_batch_or_the_cache(llm, params):
    cold = llm.generate(PROMPT, params)[0].token_ids
    assert len(cold) == N or llm.generate(PROMPT, params)[0].finish_reason == "stop"
    warm = llm.generate(PROMPT, params)[0].token_ids  # the same prompt again: a prefix cache would serve it
    copies = [o.token_ids for o in llm.generate([PROMPT] * 8, params)]
    mixed = llm.generate([*OTHERS[:3], PROMPT, *OTHERS[3:]], params)[3].token_ids  # other lengths around it
    assert warm == cold
    assert copies == [cold] * 8
    assert mixed == cold
    assert llm.engine.pages_leaked() == 0
