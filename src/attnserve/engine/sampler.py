"""Sampler: logits of one step -> one token per request.

Greedy rows take the argmax of the raw logits, so greedy output does not depend
on what else is in the batch. Sampled rows apply temperature, then top-k,
top-p and min-p filters, then draw with the exponential-race trick
(argmax of p / E, E ~ Exp(1)), which needs only uniform noise: a seeded
request draws its noise from its own generator and so gets the same tokens
whatever batch it lands in.
"""

from __future__ import annotations

import torch

from attnserve.engine.outputs import TokenLogprob
from attnserve.engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self, device: str | torch.device = "cpu", seed: int = 0):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)  # for unseeded requests
        self._request_generators: dict[int, torch.Generator] = {}

    def forget(self, rid: int) -> None:
        self._request_generators.pop(rid, None)

    def _generator_for(self, rid: int, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.generator
        g = self._request_generators.get(rid)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(params.seed)
            self._request_generators[rid] = g
        return g

    def sample(self, logits: torch.Tensor, rids: list[int], params: list[SamplingParams]) -> list[int]:
        """logits `[B, vocab]` -> B token ids (host ints)."""
        if logits.shape[0] != len(params):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(params)} requests")
        tokens = torch.argmax(logits, dim=-1)  # [B]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            probs = self.filtered_probs(logits[rows].float(), [params[i] for i in sampled])  # [S, vocab]
            noise = torch.empty_like(probs)  # [S, vocab]
            shared = [j for j, i in enumerate(sampled) if params[i].seed is None]
            if shared:  # unseeded rows draw together from the engine's generator
                idx = torch.tensor(shared, device=logits.device)
                noise[idx] = torch.empty(len(shared), probs.shape[1], device=probs.device).exponential_(
                    generator=self.generator)
            for j, i in enumerate(sampled):
                if params[i].seed is not None:
                    noise[j].exponential_(generator=self._generator_for(rids[i], params[i]))
            tokens[rows] = torch.argmax(probs / noise, dim=-1)
        return tokens.tolist()

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: list[int], params: list[SamplingParams]) -> list[TokenLogprob | None]:
        """Per row asking for them: the sampled token's log-softmax and the `params.logprobs` most likely."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        out: list[TokenLogprob | None] = [None] * len(params)
        if not rows:
            return out
        index = torch.tensor(rows, device=logits.device)
        logp = torch.log_softmax(logits[index].float(), dim=-1)  # [R, vocab]
        chosen = logp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=logits.device))  # [R, 1]
        k = max(params[i].logprobs for i in rows)
        top_lp, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())  # [R, k]
        chosen, top_lp, top_ids = chosen[:, 0].tolist(), top_lp.tolist(), top_ids.tolist()
        for j, i in enumerate(rows):
            n = params[i].logprobs
            out[i] = TokenLogprob(tokens[i], chosen[j], tuple(zip(top_ids[j][:n], top_lp[j][:n])))
        return out

    @staticmethod
    def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Probabilities after temperature, top-k, top-p and min-p, renormalised: `[S, vocab]`."""
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], device=device, dtype=torch.float32)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        vocab = probs.shape[-1]
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device, dtype=torch.float32)
        min_p = torch.tensor([p.min_p for p in params], device=device, dtype=torch.float32)
        if bool((top_k < vocab).any()) or bool((top_p < 1).any()):
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)  # [S, vocab]
            rank = torch.arange(vocab, device=device)[None, :]
            # drop a token when the tokens before it already hold top_p of the mass (the first always stays)
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            drop = (rank >= top_k[:, None]) | (mass_before >= top_p[:, None])
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        if bool((min_p > 0).any()):
            peak = probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < min_p[:, None] * peak, 0.0)
        return probs / probs.sum(dim=-1, keepdim=True)
