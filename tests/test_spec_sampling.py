"""Speculative sampling draws from the target model's distribution, and seeded runs repeat.

Many seeded requests sample their second token (the first one a verify step decides) with and
without speculation; a two-sample chi-square test compares the counts. The draft is the most
likely token, so it is accepted often but not always, and the residual draw matters. The same test
with an acceptance rule that always accepts must fail: the test can tell.
"""

from __future__ import annotations

from collections import Counter

import torch
from engine_helpers import make_engine

from attnserve.engine.sampling_params import SamplingParams
from attnserve.engine.speculative import DraftTree
from attnserve.engine.speculative import verify as verify_module
from attnserve.engine.speculative.acceptance import Acceptance

PROMPT = [5, 17, 300, 42, 9, 77]
N = 400


class FixedDrafter:
    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, req):
        return DraftTree.chain(self.tokens)

    def observe(self, req, tree, accepted):
        pass

    def forget(self, rid):
        pass


def _second_tokens(drafts=None, seed0=0, **kw) -> list[int]:
    e = make_engine(max_running_requests=64, disable_radix_cache=True, **kw)
    if drafts is not None:
        e.drafter = FixedDrafter(drafts)
    reqs = [e.add_request(PROMPT, SamplingParams(max_new_tokens=3, temperature=0.5, top_k=40, seed=seed0 + i,
                                                 ignore_eos=True)) for i in range(N)]
    e.run_until_done()
    assert e.pages_leaked() == 0
    return [r.output_ids[1] for r in reqs], [r.output_ids for r in reqs], e


def chi_square_p(a: list[int], b: list[int], min_count: int = 5) -> float:
    """Two-sample chi-square test of homogeneity; rare categories pooled into one."""
    ca, cb = Counter(a), Counter(b)
    keys = sorted(set(ca) | set(cb))
    common = [k for k in keys if ca[k] + cb[k] >= 2 * min_count]
    rows = [(ca[k], cb[k]) for k in common]
    rest = (sum(ca[k] for k in keys if k not in common), sum(cb[k] for k in keys if k not in common))
    if sum(rest):
        rows.append(rest)
    na, nb = len(a), len(b)
    stat = 0.0
    for x, y in rows:
        tot = x + y
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    df = len(rows) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _always_accept(tree, probs, uniform, draw):
    path = list(range(tree.num_real))
    return Acceptance(path, draw(probs[len(path)]))


def test_distribution_preserved_and_the_test_can_fail(monkeypatch):
    plain, _, _ = _second_tokens(seed0=0)
    mode = Counter(plain).most_common(1)[0][0]
    assert Counter(plain)[mode] < 0.8 * N  # the draft is rejected often enough for the residual to matter
    spec, _, e = _second_tokens(drafts=[mode, 3], seed0=10_000, speculative_algorithm="ngram",
                                speculative_num_draft_tokens=2)
    st = e.stats()["speculative"]
    assert 0 < st["accepted_tokens"] < st["draft_tokens"]
    assert chi_square_p(plain, spec) > 1e-3
    monkeypatch.setattr(verify_module, "accept_sampled", _always_accept)
    wrong, _, _ = _second_tokens(drafts=[mode, 3], seed0=10_000, speculative_algorithm="ngram",
                                 speculative_num_draft_tokens=2)
    assert chi_square_p(plain, wrong) < 1e-6


def test_seeded_sampling_with_speculation_is_reproducible():
    runs = [_second_tokens(drafts=[7, 8, 9], seed0=5, speculative_algorithm="ngram",
                           speculative_num_draft_tokens=3)[1][:64] for _ in range(2)]
    assert runs[0] == runs[1]
