"""Sampler: logits of one step -> one token per request.

Greedy rows take the argmax of the raw logits, so greedy output does not depend
on what else is in the batch. Sampled rows apply temperature, then top-k,
top-p and min-p filters, then draw with the exponential-race trick
(argmax of p / E, E ~ Exp(1)), which needs only uniform noise: a seeded
request draws its noise from its own generator and so gets the same tokens
whatever batch it lands in.

The race needs no normalised p (a row's common scale does not move its argmax), and
the sampler does not normalise: a sum over the vocabulary is a reduction whose order
depends on the batch on the CPU (torch splits one row's sum across threads, but sums
several rows one thread a row), so a seeded row's probabilities, and now and then its
token, changed with the number of sampled rows. With deterministic inference every
seeded row is also sampled on its own (`[1, vocab]` tensors whatever the batch), so no
kernel's choice by shape can reach it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnserve.engine.outputs import TokenLogprob
from attnserve.engine.sampling_params import SamplingParams
from attnserve.transfers import to_device


@dataclass
class DeviceLogprobs:
    """The logprobs a step's requests asked for, still on the device (read with the sampled ids)."""

    rows: list[int]  # which of the step's sampling requests asked (indices into its token list)
    counts: list[int]  # top logprobs each of them asked for
    chosen: torch.Tensor  # [R] float32: log-softmax of the sampled token
    top_logprobs: torch.Tensor  # [R, max count] float32, best first
    top_ids: torch.Tensor  # [R, max count] int64

    @classmethod
    def merge(cls, per_row: list[DeviceLogprobs | None]) -> DeviceLogprobs | None:
        """One DeviceLogprobs from the single-row ones of rows 0, 1, ... (None where a row asked none)."""
        asked = [(i, lp) for i, lp in enumerate(per_row) if lp is not None]
        if not asked:
            return None
        k = max(lp.top_ids.shape[1] for _, lp in asked)

        def widen(t: torch.Tensor) -> torch.Tensor:  # [1, k_row] -> [1, k]
            return torch.nn.functional.pad(t, (0, k - t.shape[1]))

        return cls([i for i, _ in asked], [lp.counts[0] for _, lp in asked],
                   torch.cat([lp.chosen for _, lp in asked]),
                   torch.cat([widen(lp.top_logprobs) for _, lp in asked]),
                   torch.cat([widen(lp.top_ids) for _, lp in asked]))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"chosen": self.chosen, "top_logprobs": self.top_logprobs, "top_ids": self.top_ids}

    def on_host(self, tokens: list[int], host: dict[str, torch.Tensor]) -> list[TokenLogprob | None]:
        """TokenLogprob per sampling request (None where none was asked), from the host copies of `tensors()`."""
        out: list[TokenLogprob | None] = [None] * len(tokens)
        chosen, top_lp, top_ids = host["chosen"].tolist(), host["top_logprobs"].tolist(), host["top_ids"].tolist()
        for j, (i, n) in enumerate(zip(self.rows, self.counts)):
            out[i] = TokenLogprob(tokens[i], chosen[j], tuple(zip(top_ids[j][:n], top_lp[j][:n])))
        return out


class Sampler:
    """Runs entirely on the logits' device: nothing here reads device memory from the host, so a step's
    sampling is queued behind its forward pass without the host waiting (overlap scheduling relies on it).
    Which filters run is decided from the requests' parameters, which the host knows."""

    def __init__(self, device: str | torch.device = "cpu", seed: int = 0, deterministic: bool = False):
        """deterministic: sample each seeded row on its own (see the module's docstring)."""
        self.device = torch.device(device)
        self.deterministic = deterministic
        self.generator = torch.Generator(device=self.device).manual_seed(seed)  # for unseeded requests
        self._request_generators: dict[int, torch.Generator] = {}

    def forget(self, rid: int) -> None:
        self._request_generators.pop(rid, None)

    def generator_for(self, rid: int, params: SamplingParams) -> torch.Generator:
        """The generator a request draws from: its own when seeded (made on first use), else the engine's."""
        return self._generator_for(rid, params)

    def _generator_for(self, rid: int, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.generator
        g = self._request_generators.get(rid)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(params.seed)
            self._request_generators[rid] = g
        return g

    def sample(self, logits: torch.Tensor, rids: list[int], params: list[SamplingParams]) -> torch.Tensor:
        """logits `[B, vocab]` -> token ids `[B]` int64, on the logits' device (greedy rows: the argmax)."""
        if logits.shape[0] != len(params):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(params)} requests")
        tokens = torch.argmax(logits, dim=-1)  # [B]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled:
            return tokens  # the greedy fast path: one kernel
        dev = logits.device
        alone = [i for i in sampled if self.deterministic and params[i].seed is not None]
        together = [i for i in sampled if not (self.deterministic and params[i].seed is not None)]
        if together:
            rows = to_device(together, dev)  # [S]
            tokens[rows] = self._race(logits[rows].float(), [rids[i] for i in together],
                                      [params[i] for i in together])
        for i in alone:
            tokens[i] = self._race(logits[i : i + 1].float(), [rids[i]], [params[i]])[0]
        return tokens

    def _race(self, logits: torch.Tensor, rids: list, params: list[SamplingParams]) -> torch.Tensor:
        """float32 logits `[S, vocab]` of sampled rows -> their tokens `[S]` (argmax of p / E)."""
        dev = logits.device
        probs = self.filtered_probs(logits, params, normalise=False)  # [S, vocab]
        shared = [j for j, p in enumerate(params) if p.seed is None]
        if len(shared) == len(params):  # unseeded rows draw together from the engine's generator
            noise = torch.empty_like(probs).exponential_(generator=self.generator)  # [S, vocab]
        else:
            noise = torch.empty_like(probs)  # [S, vocab]
            if shared:
                noise[to_device(shared, dev)] = torch.empty(len(shared), probs.shape[1], device=dev).exponential_(
                    generator=self.generator)
            for j, p in enumerate(params):
                if p.seed is not None:
                    noise[j].exponential_(generator=self._generator_for(rids[j], p))
        return torch.argmax(probs / noise, dim=-1)

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> DeviceLogprobs | None:
        """For the rows asking (None if none does): the sampled token's log-softmax and the
        `params.logprobs` most likely, on the device. `tokens` [B] are the sampled ids on the device."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return None
        counts = [params[i].logprobs for i in rows]
        index = to_device(rows, logits.device)  # [R]
        logp = torch.log_softmax(logits[index].float(), dim=-1)  # [R, vocab]
        chosen = logp.gather(1, tokens[index][:, None])[:, 0]  # [R]
        k = max(counts)
        top_lp, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())  # [R, k]
        return DeviceLogprobs(rows, counts, chosen, top_lp, top_ids)

    @staticmethod
    def filtered_probs(logits: torch.Tensor, params: list[SamplingParams], normalise: bool = True) -> torch.Tensor:
        """Probabilities after temperature, top-k, top-p and min-p, renormalised: `[S, vocab]`.

        normalise=False: the kept probabilities as they are (a row sums to its kept mass, not 1): what the
        race needs, without the sum over the vocabulary whose order can depend on the batch."""
        device = logits.device
        vocab = logits.shape[-1]
        temps = to_device([float(p.temperature) for p in params], device, torch.float32)  # [S]
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        if any(0 < p.top_k < vocab or p.top_p < 1 for p in params):
            top_k = to_device([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device)  # [S]
            top_p = to_device([float(p.top_p) for p in params], device, torch.float32)  # [S]
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)  # [S, vocab]
            rank = torch.arange(vocab, device=device)[None, :]
            # drop a token when the tokens before it already hold top_p of the mass (the first always stays)
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            drop = (rank >= top_k[:, None]) | (mass_before >= top_p[:, None])
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        if any(p.min_p > 0 for p in params):
            min_p = to_device([float(p.min_p) for p in params], device, torch.float32)  # [S]
            peak = probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < min_p[:, None] * peak, 0.0)
        return probs / probs.sum(dim=-1, keepdim=True) if normalise else probs
