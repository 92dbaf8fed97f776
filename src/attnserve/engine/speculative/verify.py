"""The verify step's meaning for each request: accept its drafts against the target's logits, move the
accepted branch's K/V next to the prefix, and emit the accepted tokens plus the target's own next one.

The engine launches a verify step like any other (the runner prepares it, a graph replays it where one was
captured); what differs is what its logits mean, and that lives here, beside the drafting and the acceptance
rules. Collaborators come in explicitly: the runner (the step's K/V moves), the sampler (seeded draws and
logprobs), the scheduler (settling the request's pages) and the engine's token appender (stop checks).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from attnserve.engine.request import Request
from attnserve.engine.sampler import Sampler
from attnserve.engine.speculative.acceptance import Acceptance, accept_greedy, accept_sampled
from attnserve.engine.speculative.draft_tree import DraftTree
from attnserve.engine.speculative.stats import SpecStats
from attnserve.transfers import to_device

AppendToken = Callable[[Request, int, object, float], None]  # (request, token, logprob, now): stop checks too
FailRequest = Callable[[Request, Exception], None]


def accept(r: Request, tree: DraftTree, rows: torch.Tensor, argmax: list[int], sampler: Sampler) -> Acceptance:
    """Which of `tree`'s drafts the target accepts: greedy by argmax, sampled by rejection sampling with the
    request's own generator (so a seeded request is reproducible). rows `[q, vocab]`: the logits after the
    root, then after each draft."""
    p = r.params
    if p.greedy:
        return accept_greedy(tree, argmax)
    probs = Sampler.filtered_probs(rows.float(), [p] * rows.shape[0])  # [q, vocab]
    g = sampler.generator_for(r.rid, p)
    dev = probs.device
    return accept_sampled(tree, probs, lambda: float(torch.rand((), generator=g, device=dev)),
                          lambda dist: int(torch.multinomial(dist, 1, generator=g)))


def complete_verify(batch, logits: torch.Tensor, now: float, *, drafter, stats: SpecStats, sampler: Sampler,
                    runner, scheduler, append_token: AppendToken, fail: FailRequest) -> list[Request]:
    """Every request of a verify step after its logits `[T, vocab]` are known: accepted, emitted, settled.
    A request's failure is that request's alone."""
    argmax = torch.argmax(logits, dim=-1).tolist()  # [T] on the host
    stats.verify_steps += 1
    out = []
    t = 0
    for r, tree, q in zip(batch.reqs, batch.drafts, batch.extend_lens):
        t, lo = t + q, t
        if r.finished:
            continue
        try:
            rows = logits[lo : lo + q]  # [q, vocab]: after the root, then after each draft
            acc = accept(r, tree, rows, argmax[lo : lo + q], sampler)
            _emit_accepted(r, tree, acc, rows, now, drafter, stats, sampler, runner, scheduler, append_token)
        except Exception as exc:  # noqa: BLE001 - one request's failure is that request's alone
            fail(r, exc)
        out.append(r)
    return out


def _emit_accepted(r: Request, tree: DraftTree, acc: Acceptance, rows: torch.Tensor, now: float, drafter,
                   stats: SpecStats, sampler: Sampler, runner, scheduler, append_token: AppendToken) -> None:
    """Move the accepted branch's K/V next to the prefix, then append the tokens one by one with the usual
    stop checks (the first finish cuts the rest); kv_len covers the root and the accepted drafts."""
    accepted = len(acc.path)
    if tree.num_real:  # a request without drafts rides along on padding: nothing to count
        drafter.observe(r, tree, accepted)
        r.spec_verify_steps += 1
        r.spec_draft_tokens += tree.num_real
        r.spec_accepted_tokens += accepted
        stats.record(tree.num_real, accepted)
    old = r.kv_len
    moved = [(old + 1 + node, old + depth) for depth, node in enumerate(acc.path, 1) if node + 1 != depth]
    if moved:
        slot = runner.slot_of
        runner.defer_kv_move([slot(r.pages, s) for s, _ in moved], [slot(r.pages, d) for _, d in moved])
    tokens = acc.tokens(tree)
    logprobs = [None] * len(tokens)
    if r.params.logprobs is not None:
        picked = rows[to_device(acc.rows(), rows.device)]  # [len(tokens), vocab]
        lp = sampler.logprobs(picked, to_device(tokens, rows.device), [r.params] * len(tokens))
        logprobs = lp.on_host(tokens, {k: v.cpu() for k, v in lp.tensors().items()})
    emitted = 0
    for j, (token, logprob) in enumerate(zip(tokens, logprobs), 1):
        r.kv_len = old + 1 + min(j, accepted)
        emitted += 1
        append_token(r, token, logprob, now)
        if r.finished:
            break
    stats.emitted_tokens += emitted
    scheduler.settle_verify(r, emitted)
