"""A minimal generation loop: prompts -> tokens through prefill and decode steps on the paged pool.

No scheduler, no prefix cache: every request's pages are allocated up front, all
prompts are prefilled in one extend step, then the batch decodes one token per
step until each request stops. It exists to run and test models end to end; the
engine's scheduler drives the same model API for serving.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnserve.attention.base import ForwardBatch, ForwardMode
from attnserve.kvcache.allocator import PageAllocator
from attnserve.kvcache.pool import ReqToTokenPool, make_pool


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" (an EOS token) or "length" (max_new_tokens)


def _pick(logits: torch.Tensor, temperature: float, gen: torch.Generator | None) -> torch.Tensor:
    """logits [B, vocab] float32 -> token ids [B] (greedy at temperature 0)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int = 32,
    eos_token_ids: list[int] | tuple[int, ...] = (),
    temperature: float = 0.0,
    attention_backend: str = "torch_native",
    page_size: int = 1,
    kv_dtype: str | torch.dtype | None = None,
    seed: int = 0,
    return_prefill_logits: bool = False,
) -> list[Generation] | tuple[list[Generation], torch.Tensor]:
    """Generate for every prompt (token ids). `return_prefill_logits` also returns the prompt logits [sum(len), V]."""
    from attnserve.attention.registry import create_backend

    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    param = next(model.parameters())
    device = param.device
    spec = model.kv_cache_spec()
    bs = len(prompts)
    lengths = [len(p) + max_new_tokens for p in prompts]
    pages_per_req = [(n + page_size - 1) // page_size for n in lengths]
    allocator = PageAllocator(sum(pages_per_req) + 1)
    pool = make_pool(spec, allocator.num_pages, page_size, dtype=kv_dtype or param.dtype, device=device)
    req_pool = ReqToTokenPool(bs, max(lengths), device=device)
    backend = create_backend(attention_backend, pool)
    rows = []
    for n_pages, n_tokens in zip(pages_per_req, lengths):
        row = req_pool.alloc()
        slots = pool.slots_of_pages(allocator.alloc(n_pages))[:n_tokens]
        req_pool.write(row, 0, slots)
        rows.append(row)
    gen = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None

    # prefill: every prompt in one extend step; logits only for each prompt's last token unless asked
    ext = [len(p) for p in prompts]
    fb = ForwardBatch.from_lengths(ForwardMode.EXTEND, rows, [0] * bs, ext, req_pool.req_to_token, pool,
                                   attn_backend=backend)
    backend.plan(fb)
    input_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=device)  # [T]
    last = torch.tensor(ext, device=device).cumsum(0) - 1  # [B]
    logits = model(input_ids, fb.positions, fb, logits_indices=None if return_prefill_logits else last)
    prefill_logits = logits if return_prefill_logits else None
    next_ids = _pick(logits[last] if return_prefill_logits else logits, temperature, gen).tolist()

    outputs = [[] for _ in prompts]
    finish = [""] * bs
    seq_lens = list(ext)
    eos = set(eos_token_ids)
    active = list(range(bs))
    while True:
        still = []
        for i, tok in zip(active, next_ids):
            outputs[i].append(int(tok))
            if int(tok) in eos:
                finish[i] = "stop"
            elif len(outputs[i]) >= max_new_tokens:
                finish[i] = "length"
            else:
                still.append(i)
        active = still
        if not active:
            break
        fb = ForwardBatch.from_lengths(ForwardMode.DECODE, [rows[i] for i in active], [seq_lens[i] for i in active],
                                       [1] * len(active), req_pool.req_to_token, pool, attn_backend=backend)
        backend.plan(fb)
        step_ids = torch.tensor([outputs[i][-1] for i in active], dtype=torch.int64, device=device)  # [B_active]
        logits = model(step_ids, fb.positions, fb)
        for i in active:
            seq_lens[i] += 1
        next_ids = _pick(logits, temperature, gen).tolist()
    result = [Generation(list(p), o, f) for p, o, f in zip(prompts, outputs, finish)]
    return (result, prefill_logits) if return_prefill_logits else result
