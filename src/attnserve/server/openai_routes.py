"""The OpenAI API routes (/v1/models, /v1/completions, /v1/chat/completions) and what they share: parsing,
tokenizing, the token budget, submitting a group of completions, and streaming or collecting its outputs.

Requests are validated, tokenized and checked against the context before anything is queued, so a stream's 200
headers go out only for work the engine accepted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from attnserve.engine.outputs import RequestFailed, RequestOutput
from attnserve.models.tokenizer import chat_prompt
from attnserve.server import responses as R
from attnserve.server.generation import ClientGone, Completion, CompletionGroup, ServerClosing
from attnserve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from attnserve.server.state import ServerState, Shared

SSE_DONE = "data: [DONE]\n\n"
log = logging.getLogger("attnserve.server")
router = APIRouter()


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes is over the limit of {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes")
    return bytes(body)


async def _parse(request: Request, model: type[BaseModel], state: ServerState):
    body = await _read_body(request, state.settings.max_request_bytes)
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "the body's JSON is nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    bad = _field_with_lone_surrogate(data)
    if bad is not None:
        bad = bad.encode("utf-8", "backslashreplace").decode("ascii")  # the field's own name may hold one
        raise APIError(400, f"{bad}: the text contains a lone UTF-16 surrogate (an escape such as \\ud800 "
                       "that is not half of a pair), which is not valid Unicode", bad)
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param) from None
    name = getattr(parsed, "model", None)
    if name is not None and name != state.settings.served_model_name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                       f"{state.settings.served_model_name!r}", "model", kind="NotFoundError")
    return parsed


def _field_with_lone_surrogate(data: dict) -> str | None:
    """The top-level field holding a string (or key) with a lone surrogate, else None; walks the parsed
    JSON without recursion."""
    for field, value in data.items():
        todo = [field, value]
        while todo:
            x = todo.pop()
            if isinstance(x, str):
                if not x.isascii():
                    try:
                        x.encode("utf-8")
                    except UnicodeEncodeError:
                        return field
            elif isinstance(x, list):
                todo.extend(x)
            elif isinstance(x, dict):
                todo.extend(x.keys())
                todo.extend(x.values())
    return None


def _value_error(exc: ValueError) -> APIError:
    """An engine refusal (token ids, stop token ids) as a 400 naming the field."""
    message = str(exc)
    param = ("stop_token_ids" if "stop_token_ids" in message else "max_tokens" if "lower max_new_tokens" in message
             else "prompt")
    return APIError(400, message, param)


async def _prompt_ids(state: ServerState, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    try:
        return await asyncio.to_thread(state.engine.tokenize, prompt)
    except ValueError as exc:
        raise APIError(400, str(exc), "prompt") from None


def _max_new_tokens(state: ServerState, prompt_len: int, requested: int | None) -> int:
    """Checks the prompt and max_tokens against the context, as vLLM and SGLang do. Without max_tokens, the
    request may generate up to the context or the KV pool, whichever is smaller (as SGLang clamps it)."""
    context = state.engine.max_context_len
    if prompt_len >= context:
        raise APIError(400, f"this model's maximum context length is {context} tokens; the prompt has "
                       f"{prompt_len} (it needs room for at least one new token)", "prompt",
                       code="context_length_exceeded")
    if requested is None:
        return max(1, min(context, state.pool_tokens) - prompt_len)  # a prompt over the pool: the engine says so
    if prompt_len + requested > context:
        raise APIError(400, f"this model's maximum context length is {context} tokens; the prompt has "
                       f"{prompt_len} and max_tokens asks for {requested} more", "max_tokens",
                       code="context_length_exceeded")
    return requested


async def _group(state: ServerState, completions: list[Completion]) -> CompletionGroup:
    if not state.engine.alive:
        raise APIError(503, f"the engine is not running: {state.engine.error}", kind="server_error")
    try:
        return await CompletionGroup.submit(state.engine, completions, state.admission, state.closing)
    except ValueError as exc:
        raise _value_error(exc) from None
    except RuntimeError as exc:  # the engine died meanwhile
        raise APIError(503, str(exc), kind="server_error") from None


async def _collect(state: ServerState, group: CompletionGroup, request: Request) -> list[tuple[int, RequestOutput]]:
    outputs = []
    try:
        async with aclosing(group.events(request.receive)) as events:
            async for choice, event in events:
                if event.finished:
                    state.metrics.observe(event.output)
                    outputs.append((choice, event.output))
    except RequestFailed as exc:
        raise APIError(500, f"the request failed in the engine: {exc}", kind="server_error") from None
    except RuntimeError as exc:
        raise APIError(500, f"the engine failed: {exc}", kind="server_error") from None
    except ServerClosing:
        raise _closing_error() from None
    finally:
        group.end(state.metrics.ended_without_output)
    return sorted(outputs, key=lambda x: x[0])


def _closing_error() -> APIError:
    return APIError(503, "the server is shutting down and its grace period ran out; the request was cut short",
                    kind="server_error", code="server_shutting_down")


async def _stream(state: ServerState, group: CompletionGroup, request: Request, chunks) -> AsyncIterator[str]:
    """SSE lines: chunks(choice, event) per event, usage last when asked for, an error chunk if it fails."""
    finished: list[RequestOutput] = []
    try:
        for line in chunks.start():
            yield line
        async with aclosing(group.events(request.receive)) as events:  # closed wherever this generator stops
            async for choice, event in events:
                for line in chunks.event(choice, event):
                    yield line
                if event.finished:
                    state.metrics.observe(event.output)
                    finished.append(event.output)
        for line in chunks.end(finished):
            yield line
    except ClientGone:
        return
    except (RequestFailed, RuntimeError) as exc:
        yield R.sse(APIError(500, f"the request failed: {exc}", kind="server_error").body())
    except ServerClosing:
        yield R.sse(_closing_error().body())
    finally:
        group.end(state.metrics.ended_without_output)
    yield SSE_DONE


class GroupStream(StreamingResponse):
    """The SSE stream of a completion group, ended however the response ends.

    Cancelled while a send waits (the client gone: Starlette's disconnect listener cancels the sending task, and
    under the `http` middleware every send waits for the middleware to take the message), a StreamingResponse
    leaves its generator suspended at a yield, never closed: its completions kept generating and went uncounted
    until garbage collection finalised it. Here the generator is closed and the group ended when the response
    is, even one whose generator never started."""

    def __init__(self, state: ServerState, group: CompletionGroup, request: Request, chunks):
        super().__init__(_stream(state, group, request, chunks), media_type="text/event-stream")
        self.end_group = lambda: group.end(state.metrics.ended_without_output)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # its cleanup does not wait: it runs under a cancellation too
            self.end_group()


class _CompletionChunks:
    def __init__(self, rid: str, state: ServerState, req: CompletionRequest, echo: dict[int, str], n_choices: int):
        self.rid, self.state, self.req, self.echo = rid, state, req, echo
        self.model = state.settings.served_model_name
        self.created = int(time.time())
        self.offsets = dict.fromkeys(range(n_choices), 0)
        self.n = req.n

    def start(self):
        for choice in self.offsets:
            prefix = self.echo.get(choice // self.n, "")
            if prefix:
                self.offsets[choice] = len(prefix)
                yield R.sse(R.completion_chunk(self.rid, self.model, self.created, choice, prefix))

    def event(self, choice: int, event):
        logprobs = None
        if event.logprobs:
            logprobs = R.completion_logprobs(event.logprobs, self.state.token_text, self.offsets[choice])
        self.offsets[choice] += len(event.text)
        if event.text or logprobs or event.finished:
            finish = R.finish_reason(event.output) if event.finished else None
            yield R.sse(R.completion_chunk(self.rid, self.model, self.created, choice, event.text, logprobs, finish))

    def end(self, outputs):
        if self.req.include_usage:
            yield R.sse(R.usage_chunk(self.rid, "text_completion", self.model, self.created, outputs))


class _ChatChunks:
    def __init__(self, rid: str, state: ServerState, req: ChatCompletionRequest, n_choices: int):
        self.rid, self.state, self.req = rid, state, req
        self.model = state.settings.served_model_name
        self.created = int(time.time())
        self.n_choices = n_choices

    def start(self):
        for choice in range(self.n_choices):  # the role first, as OpenAI streams it
            yield R.sse(R.chat_chunk(self.rid, self.model, self.created, choice, {"role": "assistant", "content": ""}))

    def event(self, choice: int, event):
        logprobs = R.chat_logprobs(event.logprobs, self.state.token_text) if event.logprobs else None
        if event.text or logprobs:
            yield R.sse(R.chat_chunk(self.rid, self.model, self.created, choice, {"content": event.text}, logprobs))
        if event.finished:
            yield R.sse(R.chat_chunk(self.rid, self.model, self.created, choice, {}, None,
                                     R.finish_reason(event.output)))

    def end(self, outputs):
        if self.req.include_usage:
            yield R.sse(R.usage_chunk(self.rid, "chat.completion.chunk", self.model, self.created, outputs))


# ---- the app ----------------------------------------------------------------------------------------


@router.get("/v1/models")
async def models(state: Shared):
    return {"object": "list", "data": [{
        "id": state.settings.served_model_name, "object": "model", "created": state.created,
        "owned_by": "attnserve", "max_model_len": state.engine.max_context_len}]}


@router.post("/v1/completions")
async def completions(request: Request, state: Shared):
    req = await _parse(request, CompletionRequest, state)
    prompts = req.prompts()
    ids = [await _prompt_ids(state, p) for p in prompts]
    budgets = [_max_new_tokens(state, len(x), req.max_tokens) for x in ids]
    completions = []
    for i, (prompt_ids, budget) in enumerate(zip(ids, budgets)):
        params = req.sampling_params(budget, req.logprobs)
        completions += [Completion(i * req.n + j, prompt_ids, params.for_completion(j) if req.n > 1 else params,
                                   req.speculative) for j in range(req.n)]
    echo = {i: (p if isinstance(p, str) else state.engine.tokenizer.decode(p))
            for i, p in enumerate(prompts)} if req.echo and state.engine.tokenizer is not None else {}
    group = await _group(state, completions)
    rid = R.new_id("cmpl")
    if req.stream:
        chunks = _CompletionChunks(rid, state, req, echo, len(completions))
        return GroupStream(state, group, request, chunks)
    try:
        outputs = await _collect(state, group, request)
    except ClientGone:
        return Response(status_code=499)
    return R.completion_body(rid, state.settings.served_model_name, outputs, echo, state.token_text)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, state: Shared):
    req = await _parse(request, ChatCompletionRequest, state)
    try:
        text = await asyncio.to_thread(chat_prompt, state.engine.tokenizer, state.engine.chat_template,
                                       req.rendered_messages())
    except ValueError as exc:
        raise APIError(400, str(exc), "messages") from None
    prompt_ids = await _prompt_ids(state, text)
    budget = _max_new_tokens(state, len(prompt_ids), req.max_completion_tokens or req.max_tokens)
    params = req.sampling_params(budget, req.num_top_logprobs)
    completions = [Completion(j, prompt_ids, params.for_completion(j) if req.n > 1 else params, req.speculative)
                   for j in range(req.n)]
    group = await _group(state, completions)
    rid = R.new_id("chatcmpl")
    if req.stream:
        chunks = _ChatChunks(rid, state, req, len(completions))
        return GroupStream(state, group, request, chunks)
    try:
        outputs = await _collect(state, group, request)
    except ClientGone:
        return Response(status_code=499)
    return R.chat_body(rid, state.settings.served_model_name, outputs, state.token_text)
