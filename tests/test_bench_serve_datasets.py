"""bench serve prompts: exact token lengths, length spread, shared system prompts, JSONL checks."""

import json

import pytest

from attnserve.bench.serve.datasets import (
    TokenSampler,
    jsonl_requests,
    load_tokenizer,
    random_requests,
    shared_prefix_requests,
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
    reqs = random_requests(sampler, 50, 40, 20, 0.5, seed=0)
    assert all(20 <= r.prompt_len <= 40 and 10 <= r.output_len <= 20 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 5


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
