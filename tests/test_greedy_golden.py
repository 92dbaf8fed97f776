"""Greedy tokens pinned across refactors of the house (moves between packages must change no output).

Tiny random-weight models (a Llama and a DeepSeek-V2 with MLA and MoE, fp32 on the CPU, where the engine runs
torch_native and flex_attention) run staggered arrivals through the engine, with the radix cache, small chunks and a small step budget, so prefill chunks, mixed steps,
cached prefixes and decode all run; each backend's greedy tokens must equal `data/greedy_golden.json`. The file
was written by this module (`python tests/test_greedy_golden.py --write`) on commit e074159, before the packages moved
(batch.py, choice/, analysis/, reference/): regenerate it only for a change meant to alter outputs, and say so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from engine_helpers import TINY_DEEPSEEK, VOCAB, prompts, tiny_model

from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine
from attnserve.engine.sampling_params import SamplingParams

GOLDEN = Path(__file__).parent / "data" / "greedy_golden.json"
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
CASES = {  # name: (model config, engine settings)
    "llama-torch_native": (LLAMA, {"attention_backend": "torch_native"}),
    "llama-torch_native-page4": (LLAMA, {"attention_backend": "torch_native", "page_size": 4}),
    "llama-flex-page2": (LLAMA, {"attention_backend": "flex_attention", "page_size": 2}),
    "deepseek-torch_native": (TINY_DEEPSEEK, {"attention_backend": "torch_native"}),
    "deepseek-torch_native-page4": (TINY_DEEPSEEK, {"attention_backend": "torch_native", "page_size": 4}),
}
NEW_TOKENS = 8


def greedy(case: str) -> list[list[int]]:
    config, settings = CASES[case]
    engine = Engine(EngineConfig(device="cpu", max_total_tokens=2048, max_running_requests=8, chunked_prefill_size=16,
                                 max_num_batched_tokens=24, **settings), loaded=tiny_model(config, seed=3))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    reqs = []
    for p in prompts(8, seed=5, shared_prefix=10, lo=3, hi=40):  # staggered: chunks, mixed steps, radix hits
        reqs.append(engine.add_request(p, params))
        engine.step()
    engine.run_until_done()
    assert engine.pages_leaked() == 0
    return [list(r.output_ids) for r in reqs]


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_equal_the_pinned_ones(case):
    golden = json.loads(GOLDEN.read_text())
    assert greedy(case) == golden[case]


if __name__ == "__main__":  # python tests/test_greedy_golden.py --write  (from the repository root)
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_greedy_golden.py --write")
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({case: greedy(case) for case in sorted(CASES)}, indent=1) + "\n")
    print(f"wrote {GOLDEN}")
