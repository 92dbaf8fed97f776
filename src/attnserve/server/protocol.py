"""The OpenAI request bodies the server accepts, as pydantic models, and their mapping to SamplingParams.

Strict types (a string where a number belongs is refused, not coerced) and the
ranges of every sampling field are checked here, so a bad request is answered
with a 400 naming the field before it reaches the engine. Fields of the OpenAI
API that the engine cannot honour are refused when set, never ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from attnserve.engine.sampling_params import MAX_N, MAX_SEED, MAX_TOP_LOGPROBS, SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions

MAX_TOKENS_HELP = (
    "Without max_tokens, /v1/chat/completions generates up to what both the context and the KV pool leave after "
    f"the prompt, while /v1/completions stops at {COMPLETIONS_DEFAULT_MAX_TOKENS} new tokens, as OpenAI's and "
    "vLLM's completions do (max_tokens: null gives it the chat limit); a max_tokens (or max_completion_tokens) "
    "over that limit is refused with 400."
)
"""What a request without max_tokens generates, per endpoint (`attnserve serve --help` says it too)."""


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code = code or {400: "invalid_value", 401: "invalid_api_key", 404: "model_not_found",
                             413: "request_too_large", 503: "overloaded"}.get(status)
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extension: false opts this request out of speculative decoding (when the server speculates)
    speculative: bool = True
    # OpenAI fields the engine has no implementation of: refused when set to anything but their neutral value
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            if getattr(self, name) != neutral:
                raise APIError(400, f"{name} is not supported by this server", name, code="unsupported")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", "logit_bias", code="unsupported")
        if self.best_of not in (None, self.n):
            raise APIError(400, "best_of other than n is not supported by this server", "best_of", code="unsupported")
        if isinstance(self.stop, list) and not all(self.stop):
            raise APIError(400, "stop strings must be non-empty", "stop")
        if isinstance(self.stop, str) and not self.stop:
            self.stop = None
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_new_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                max_new_tokens=max_new_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                min_p=self.min_p, seed=self.seed, stop=self.stop or (), stop_token_ids=self.stop_token_ids or (),
                ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens, logprobs=logprobs,
            )
        except ValueError as exc:  # the engine's own bounds; name the API field
            field = str(exc).split("=", 1)[0].removeprefix("SamplingParams.")
            raise APIError(400, str(exc), {"max_new_tokens": "max_tokens"}.get(field, field)) from None


class CompletionRequest(_Sampling):
    """/v1/completions. max_tokens left out: at most 16 new tokens (OpenAI's and vLLM's default); null: up to
    what the context and the KV pool leave after the prompt (MAX_TOKENS_HELP)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(COMPLETIONS_DEFAULT_MAX_TOKENS, ge=1,
                                   description="new tokens at most; left out: 16, null: the context / KV pool limit")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_prompt(self):
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", "suffix", code="unsupported")
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs (prompt logprobs) is not supported by this server", "echo",
                           code="unsupported")
        prompts = self.prompts()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise APIError(400, "prompt must not be empty", "prompt")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (a string or a token-id list each)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    """/v1/chat/completions. Neither max_completion_tokens nor max_tokens: up to what the context and the KV pool
    leave after the rendered prompt (MAX_TOKENS_HELP)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1,
                                   description="new tokens at most; left out: the context / KV pool limit")
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens; it wins")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return self

    @property
    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def rendered_messages(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
