"""OpenAI response bodies and stream chunks, built from the engine's outputs.

Plain dicts (serialised once with json.dumps) rather than pydantic models:
a chunk per token per request is the server's hot path.
"""

from __future__ import annotations

import json
import time
import uuid

from attnserve.engine.outputs import RequestOutput, TokenLogprob


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(data: dict | str) -> str:
    """One server-sent event: `data: ...` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def finish_reason(output: RequestOutput) -> str:
    return output.finish_reason if output.finish_reason in ("stop", "length") else "abort"


def usage(outputs: list[RequestOutput]) -> dict:
    """Prompt tokens count once per prompt (n completions of one prompt share it), as OpenAI does."""
    prompt = {o.index: len(o.prompt_token_ids) for o in outputs}
    cached = {o.index: o.cached_tokens for o in outputs}
    completion = sum(len(o.token_ids) for o in outputs)
    out = {
        "prompt_tokens": sum(prompt.values()),
        "completion_tokens": completion,
        "total_tokens": sum(prompt.values()) + completion,
        "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
    }
    steps = sum(o.spec_verify_steps for o in outputs)
    if steps:  # speculative decoding ran for these completions: what it proposed and what was kept
        drafts, accepted = sum(o.spec_draft_tokens for o in outputs), sum(o.spec_accepted_tokens for o in outputs)
        out["x_speculative"] = {"verify_steps": steps, "draft_tokens": drafts, "accepted_tokens": accepted,
                                "acceptance_rate": round(accepted / drafts, 4) if drafts else None,
                                "accepted_tokens_per_step": round(accepted / steps, 4)}
    return out


class TokenText:
    """Each token's own text, for logprobs (a token that is part of a multi-byte character shows U+FFFD)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return str(token_id)
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(lps: list[TokenLogprob], token_text: TokenText, text_offset: int) -> dict:
    """The legacy completions format: parallel lists, top alternatives as {token text: logprob}."""
    tokens = [token_text(lp.token_id) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{token_text(t): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def chat_logprobs(lps: list[TokenLogprob], token_text: TokenText) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}


def completion_body(rid: str, model: str, outputs: list[tuple[int, RequestOutput]], echo_prompts: dict[int, str],
                    token_text: TokenText) -> dict:
    choices = []
    for index, o in outputs:
        prefix = echo_prompts.get(o.index, "")
        choices.append({
            "index": index,
            "text": prefix + o.text,
            "logprobs": completion_logprobs(o.logprobs, token_text, len(prefix)) if o.logprobs is not None else None,
            "finish_reason": finish_reason(o),
            "stop_reason": o.matched_stop,
        })
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage([o for _, o in outputs])}


def chat_body(rid: str, model: str, outputs: list[tuple[int, RequestOutput]], token_text: TokenText) -> dict:
    choices = [{
        "index": index,
        "message": {"role": "assistant", "content": o.text},
        "logprobs": chat_logprobs(o.logprobs, token_text) if o.logprobs is not None else None,
        "finish_reason": finish_reason(o),
        "stop_reason": o.matched_stop,
    } for index, o in outputs]
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage([o for _, o in outputs])}


def completion_chunk(rid: str, model: str, created: int, index: int, text: str, logprobs: dict | None = None,
                     finish: str | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def chat_chunk(rid: str, model: str, created: int, index: int, delta: dict, logprobs: dict | None = None,
               finish: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


def usage_chunk(rid: str, obj: str, model: str, created: int, outputs: list[RequestOutput]) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(outputs)}
