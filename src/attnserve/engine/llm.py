"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`.

All prompts are submitted at once and the engine batches them continuously;
outputs come back in input order. `stream` yields text as it is produced,
which is what the CLI prints and what an HTTP server would forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from attnserve.engine.config import EngineConfig
from attnserve.engine.detokenizer import Detokenizer
from attnserve.engine.engine import Engine
from attnserve.engine.request import Request
from attnserve.engine.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class RequestOutput:
    index: int  # position of the prompt in the input
    completion: int  # which of the n completions (0 unless n > 1)
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    matched_stop: str | int | None = None
    cached_tokens: int = 0  # prompt tokens served by the prefix cache at the last admission
    num_preemptions: int = 0
    ttft_s: float | None = None  # submission -> first token
    tpot_s: float | None = None  # mean time per output token after the first
    token_latencies_s: list[float] = field(default_factory=list)  # gaps between consecutive tokens

    @classmethod
    def from_request(cls, req: Request, index: int, completion: int) -> RequestOutput:
        return cls(
            index=index,
            completion=completion,
            prompt=req.prompt,
            prompt_token_ids=list(req.prompt_ids),
            text=req.text,
            token_ids=list(req.output_ids),
            finish_reason=req.finish_reason.value if req.finish_reason else "unknown",
            matched_stop=req.matched_stop,
            cached_tokens=req.cached_len,
            num_preemptions=req.num_preemptions,
            ttft_s=req.ttft_s,
            tpot_s=req.tpot_s,
            token_latencies_s=req.inter_token_latencies_s,
        )

    def to_json(self) -> dict:
        """The shape `attnserve generate --json` prints, one object per completion."""
        return {
            "prompt": self.prompt,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 6),
            "tpot_s": None if self.tpot_s is None else round(self.tpot_s, 6),
            "cached_tokens": self.cached_tokens,
        }


@dataclass
class StreamEvent:
    index: int
    completion: int
    text: str  # new text since the previous event of this completion
    token_ids: list[int]  # new tokens since the previous event
    finished: bool
    output: RequestOutput | None = None  # set on the last event


class LLM:
    def __init__(self, model: str | None = None, attention_backend: str | None = None, *, loaded=None,
                 **engine_settings):
        """engine_settings: any EngineConfig field (device, dtype, page_size, chunked_prefill_size, ...)."""
        config = EngineConfig(model=model, attention_backend=attention_backend, **engine_settings)
        self.engine = Engine(config, loaded=loaded)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def apply_chat_template(self, prompt: str | list[dict], system: str | None = None) -> str:
        """Render one user message (or a message list) with the model's chat template."""
        template = self.engine.parts.model.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError("this model has no chat template; drop --chat")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        render = getattr(self.tokenizer, "apply_chat_template", None)
        if callable(render):
            return render(messages)
        from attnserve.models.tokenizer import render_chat_template

        # a template shipped inside a model file is untrusted code: render it sandboxed
        return render_chat_template(template, messages, add_generation_prompt=True,
                                    special_tokens={"bos_token": "", "eos_token": ""})

    def _submit(self, prompts, sampling_params) -> dict:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts; give one or one each")
        owners: dict = {}
        submitted = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                for j in range(p.n):
                    seed = None if p.seed is None else p.seed + j
                    req = self.engine.add_request(prompt, p.with_seed(seed) if p.n > 1 else p)
                    owners[req.rid] = (i, j, req)
                    submitted.append(req.rid)
        except Exception:
            for rid in submitted:  # nothing half-submitted stays behind
                self.engine.abort(rid)
            raise
        return owners

    def stream(self, prompts: Prompt | list[Prompt], sampling_params=None) -> Iterator[StreamEvent]:
        """Submit every prompt, then yield text as each completion produces it."""
        owners = self._submit(prompts, sampling_params)
        sent_tokens = {rid: 0 for rid in owners}
        try:
            while any(not req.finished for _, _, req in owners.values()):
                for req in self.engine.step():
                    if req.rid not in owners:
                        continue
                    i, j, _ = owners[req.rid]
                    new_ids = req.output_ids[sent_tokens[req.rid]:]
                    sent_tokens[req.rid] = len(req.output_ids)
                    out = RequestOutput.from_request(req, i, j) if req.finished else None
                    yield StreamEvent(i, j, Detokenizer.streamable(req), new_ids, req.finished, out)
        finally:
            for _, _, req in owners.values():  # a consumer that stops early must not leak pages
                if not req.finished:
                    self.engine.abort(req.rid)

    def generate(self, prompts: Prompt | list[Prompt], sampling_params=None) -> list[RequestOutput]:
        """Outputs in input order (a prompt with n > 1 gives n consecutive outputs)."""
        done: dict[tuple[int, int], RequestOutput] = {}
        for ev in self.stream(prompts, sampling_params):
            if ev.finished:
                done[(ev.index, ev.completion)] = ev.output
        return [done[k] for k in sorted(done)]

    def stats(self) -> dict:
        return self.engine.stats()
