"""Sampler and SamplingParams: filters keep the right tokens, seeds reproduce, bad values are named."""

import pytest
import torch

from attnserve.engine.sampler import Sampler
from attnserve.engine.sampling_params import SamplingParams


def test_greedy_is_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams()] * 5
    assert Sampler().sample(logits, list(range(5)), params).tolist() == logits.argmax(-1).tolist()


def test_top_k_keeps_only_k_most_likely():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=1.0, top_k=5)
    probs = Sampler.filtered_probs(logits, [p])
    kept = set(torch.nonzero(probs[0]).flatten().tolist())
    assert kept == set(logits[0].topk(5).indices.tolist())
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-5)


def test_top_p_keeps_smallest_set_reaching_p():
    # probabilities 0.5, 0.3, 0.15, 0.05
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]]))
    probs = Sampler.filtered_probs(logits, [SamplingParams(temperature=1.0, top_p=0.8)])
    assert torch.nonzero(probs[0]).flatten().tolist() == [1, 3]
    probs = Sampler.filtered_probs(logits, [SamplingParams(temperature=1.0, top_p=0.81)])
    assert torch.nonzero(probs[0]).flatten().tolist() == [1, 2, 3]


def test_min_p_drops_tokens_below_fraction_of_peak():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = Sampler.filtered_probs(logits, [SamplingParams(temperature=1.0, min_p=0.25)])
    assert torch.nonzero(probs[0]).flatten().tolist() == [0, 1, 2]


def test_seeded_requests_reproduce_regardless_of_batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 200, generator=g) * 0.1  # [4, 200], nearly flat: each draw could be almost any token
    seeded = SamplingParams(temperature=1.0, seed=42)
    other = SamplingParams(temperature=0.7)
    other_seeded = SamplingParams(temperature=1.0, seed=43)
    alone_sampler = Sampler()
    alone = [int(alone_sampler.sample(logits[2:3], [7], [seeded])[0]) for _ in range(12)]
    # in a batch whose other rows change every step, the seeded row draws what it drew alone, step by step
    s = Sampler(seed=123)
    batched = []
    for step in range(12):
        rids, params = ([1, 2, 7, 9], [other, other_seeded, seeded, other]) if step % 2 else ([7], [seeded])
        rows = logits if step % 2 else logits[2:3]
        batched.append(int(s.sample(rows, rids, params)[rids.index(7)]))
    assert batched == alone
    # a restarted generator would redraw its first token every step
    assert len(set(alone)) > 1


def test_a_seeded_request_keeps_one_stream_across_steps():
    """The same logits every step: a request's draws follow the distribution, as one stream of noise does.

    A generator restarted each step (from the request's seed) would draw the same token every time.
    """
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    s = Sampler()
    p = SamplingParams(temperature=1.0, seed=9)
    draws = [int(s.sample(logits, [0], [p])[0]) for _ in range(3000)]
    freq = [draws.count(i) / len(draws) for i in range(3)]
    assert freq == pytest.approx([0.7, 0.2, 0.1], abs=0.04)
    # and the stream is the request's own: a second sampler replays it exactly
    again = Sampler(seed=77)
    assert [int(again.sample(logits, [5], [p])[0]) for _ in range(3000)] == draws


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    s = Sampler(seed=0)
    p = SamplingParams(temperature=1.0)
    draws = [int(s.sample(logits, [0], [p])[0]) for _ in range(3000)]
    freq = [draws.count(i) / len(draws) for i in range(3)]
    assert freq == pytest.approx([0.7, 0.2, 0.1], abs=0.04)


@pytest.mark.parametrize(
    "field,value",
    [("max_new_tokens", 0), ("temperature", -0.1), ("top_k", -2), ("top_p", 0.0), ("top_p", 1.5),
     ("min_p", 1.2), ("seed", -1), ("n", 0), ("stop", [""]), ("stop_token_ids", [-3])],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_stop_string_alone_becomes_a_tuple():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_sampling_and_logprobs_read_nothing_back_to_the_host():
    """Every filter, seeded and unseeded rows, greedy rows and logprobs: all queued, nothing read."""
    from host_reads import no_host_reads

    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))  # [5, 64]
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=5, logprobs=3),
              SamplingParams(temperature=1.0, top_p=0.7, seed=11), SamplingParams(temperature=0.5, min_p=0.2),
              SamplingParams(temperature=1.2, seed=12, logprobs=0)]
    s = Sampler(seed=5)
    with no_host_reads():
        tokens = s.sample(logits, list(range(5)), params)  # [5]
        lps = Sampler.logprobs(logits, tokens, params)
        greedy = s.sample(logits, list(range(5)), [SamplingParams()] * 5)
    assert greedy.tolist() == logits.argmax(-1).tolist()
    assert tokens[0] == logits[0].argmax() and lps.rows == [1, 4] and lps.counts == [3, 0]
    host = lps.on_host(tokens.tolist(), lps.tensors())
    ref = torch.log_softmax(logits[1], -1)
    assert host[1].logprob == pytest.approx(ref[int(tokens[1])].item(), abs=1e-5)
    assert [t for t, _ in host[1].top] == ref.topk(3).indices.tolist() and host[4].top == ()
