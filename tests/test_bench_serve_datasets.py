"""bench serve prompts: exact token lengths, length spread, ShareGPT-like lengths, shared system prompts, JSONL."""

import json

import numpy as np
import pytest

from attnserve.bench.serve.datasets import (
    SHAREGPT_INPUT_MEAN,
    SHAREGPT_MAX_INPUT,
    SHAREGPT_MAX_TOTAL,
    SHAREGPT_MIN_LEN,
    SHAREGPT_OUTPUT_MEAN,
    SHAREGPT_SIGMA,
    TokenSampler,
    jsonl_requests,
    load_tokenizer,
    random_requests,
    shared_prefix_requests,
    sharegpt_lengths,
    sharegpt_synthetic_requests,
)
from attnserve.bench.serve.synthetic import write_tokenizer_dir


@pytest.fixture(scope="module")
def sampler(tmp_path_factory):
    path = tmp_path_factory.mktemp("words")
    write_tokenizer_dir(path, vocab_size=300)
    return TokenSampler(load_tokenizer(str(path)))


def test_random_prompts_have_the_exact_length_asked_for(sampler):
    reqs = random_requests(sampler, 5, 40, 7, 0.0, seed=3)
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(40, 7)] * 5
    assert all(len(sampler.encode(r.prompt)) == 40 for r in reqs)
    assert random_requests(sampler, 5, 40, 7, 0.0, seed=3) == reqs  # a seed reproduces its prompts
    assert random_requests(sampler, 5, 40, 7, 0.0, seed=4) != reqs


def test_range_ratio_spreads_lengths_within_bounds(sampler):
    # vllm bench serve --random-range-ratio r: uniform in [len * (1 - r), len * (1 + r)]
    reqs = random_requests(sampler, 60, 40, 20, 0.5, seed=0)
    assert all(20 <= r.prompt_len <= 60 and 10 <= r.output_len <= 30 for r in reqs)
    assert min(r.prompt_len for r in reqs) < 30 and max(r.prompt_len for r in reqs) > 50  # both sides of 40
    assert len({r.prompt_len for r in reqs}) > 5


def test_sharegpt_synthetic_lengths_follow_their_documented_parameters():
    lengths = np.array(sharegpt_lengths(np.random.default_rng(0), 20_000))  # [n, 2]: input, output
    ins, outs = lengths[:, 0], lengths[:, 1]
    assert ins.min() >= SHAREGPT_MIN_LEN and ins.max() <= SHAREGPT_MAX_INPUT
    assert outs.min() >= SHAREGPT_MIN_LEN and (ins + outs).max() <= SHAREGPT_MAX_TOTAL
    # medians are exp(mu) = mean * exp(-sigma^2 / 2), untouched by the bounds (they clip only the tails)
    for got, mean in ((ins, SHAREGPT_INPUT_MEAN), (outs, SHAREGPT_OUTPUT_MEAN)):
        assert np.median(got) == pytest.approx(mean * np.exp(-SHAREGPT_SIGMA**2 / 2), rel=0.05)
        assert 0.85 * mean < got.mean() < 1.0 * mean  # the caps pull the mean a little below the target
        assert np.log(got[(got > SHAREGPT_MIN_LEN) & (got < 600)]).std() > 0.6  # a real spread, not a constant


def test_sharegpt_synthetic_prompts_have_their_drawn_lengths(sampler):
    reqs = sharegpt_synthetic_requests(sampler, 6, seed=2)
    want = sharegpt_lengths(np.random.default_rng(2), 6)
    assert [(r.prompt_len, r.output_len) for r in reqs] == want
    assert all(len(sampler.encode(r.prompt)) == r.prompt_len for r in reqs)


def test_shared_prefix_groups_share_their_system_prompt(sampler):
    reqs = shared_prefix_requests(
        sampler, 6, num_groups=2, system_len=30, question_len=5, output_len=3, seed=0
    )
    prefixes = [r.prompt.split("\n")[0] for r in reqs]
    assert prefixes[0] == prefixes[2] == prefixes[4] != prefixes[1] == prefixes[3] == prefixes[5]
    assert len({r.prompt for r in reqs}) == 6 and all(r.prompt_len == 35 for r in reqs)


def test_jsonl_rows_and_errors_naming_the_line(tmp_path, sampler):
    good = tmp_path / "good.jsonl"
    good.write_text(
        json.dumps({"prompt": "w3 w4 w5", "output_len": 9})
        + "\n\n"
        + json.dumps({"prompt": "w6", "output_len": 1})
        + "\n"
    )
    reqs = jsonl_requests(good, None, sampler.tok)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs] == [("w3 w4 w5", 3, 9), ("w6", 1, 1)]
    assert len(jsonl_requests(good, 1)) == 1
    for line, message in [
        ('{"prompt": "x", "output_len": 0}', r":1: 'output_len' must be an integer >= 1, got 0"),
        ('{"prompt": "", "output_len": 2}', r":1: 'prompt' must be a non-empty string"),
        ("not json", r":1: not JSON"),
    ]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(line + "\n")
        with pytest.raises(ValueError, match=message):
            jsonl_requests(bad, None)


def test_a_directory_without_a_tokenizer_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer at"):
        load_tokenizer(str(tmp_path))
