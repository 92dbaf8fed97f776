"""The embedded SmolLM2 in bf16 and with 4-bit weights, against the same engine in fp32 (itself held
identical to transformers by test_models_gguf).

Tolerances, and why:
- logits: max |bf16 - fp32| / max |fp32| < 0.1 at every position where the two runs have generated
  the same tokens so far. bf16 keeps 8 significant bits (0.4% per rounding) and 30 layers accumulate
  it; measured over those positions, per prompt: 1.3-4.0% dequantised, 1.5-3.0% auto, 1.9-5.1% int4
  only (its scales and zeros are bf16 too). A wrong nibble order, group or zero gives errors of order 1.
- greedy: a prompt's continuation may part from fp32's only at a near-tie, a step where fp32's two best
  logits are closer than twice the two runs' logit error there, and at least half the prompts agree on all
  24. Greedy decoding flips at the first near-tie and then follows another text for good, so agreement
  holds on a prefix and on most prompts, not all (measured on a Xeon with AMX: 4 or 5 of 6 prompts agree on
  all 24 tokens, the others on their first 5-13; on an AVX2-only EPYC, where bf16 runs without oneDNN's
  prepacked path, one prompt parted at its third token).
Two requests run at a time so decode steps have 1-2 rows: the int4 kernel's range under `auto`.
"""

from __future__ import annotations

import pytest
import torch
from engine_runs import max_rel_err, run_engine

from attnserve.models.loader import load_model

pytestmark = pytest.mark.needs_embedded_model  # every test runs the embedded SmolLM2

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):",
    "Water boils at",
    "List three uses of a paper clip:",
]
NEW_TOKENS = 24


def _runs(bundle, ids, **settings):
    return run_engine(bundle, ids, NEW_TOKENS, max_running_requests=2, **settings)


@pytest.fixture(scope="module")
def fp32_runs():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # steadier on a busy 2-core box
    bundle = load_model(None, dtype=torch.float32)
    ids = [bundle.tokenizer.encode(p) for p in PROMPTS]
    yield ids, _runs(bundle, ids)
    torch.set_num_threads(before)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("weights", ["auto", "dequantized", "int4"])
def test_bf16_and_int4_stay_close_to_fp32(fp32_runs, weights):
    ids, ref = fp32_runs
    bundle = load_model(None, dtype=torch.bfloat16)
    runs = _runs(bundle, ids, weights_dtype=weights)
    expected_note = {"auto": "int4 + bf16", "dequantized": "dequantized", "int4": "int4 ("}[weights]
    assert bundle.model._weights_note.startswith(expected_note)
    prefixes = []
    for run, fp32 in zip(runs, ref):
        n = _common_prefix(run.token_ids, fp32.token_ids)
        prefixes.append(n)
        # rows 0..n: the logits each side sampled from while their texts were still the same
        rel = max_rel_err(run.logits[: n + 1], fp32.logits[: n + 1])
        assert rel < 0.1, f"{weights}: logits differ from fp32 by {rel:.3f} (relative to the largest)"
        if n < NEW_TOKENS:  # parted at token n: only a near-tie may do that
            ref_row, row = fp32.logits[n].float(), run.logits[n].float()
            best, second = ref_row.topk(2).values.tolist()
            err = float((row - ref_row).abs().max())
            assert best - second <= 2 * err, (
                f"{weights}: parted at token {n} though fp32's choice led by {best - second:.3f} (error {err:.3f})")
    assert sum(n == NEW_TOKENS for n in prefixes) >= len(PROMPTS) // 2, f"{weights}: {prefixes}"
