"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`.

All prompts are submitted at once and the engine batches them continuously;
outputs come back in input order. `stream` yields text as it is produced,
which is what the CLI prints and what an HTTP server would forward.
"""

from __future__ import annotations

from collections.abc import Iterator

from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine
from attnserve.engine.outputs import RequestOutput, RequestStream, StreamEvent, TokenDelta
from attnserve.engine.sampling_params import SamplingParams
from attnserve.models.tokenizer import chat_prompt

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, attention_backend: str | None = None, *, loaded=None,
                 config: EngineConfig | None = None, **engine_settings):
        """engine_settings: any EngineConfig field (device, dtype, page_size, chunked_prefill_size, ...);
        or `config`, an EngineConfig already built (the command line's)."""
        if config is None:
            config = EngineConfig(model=model, attention_backend=attention_backend, **engine_settings)
        elif model is not None or attention_backend is not None or engine_settings:
            raise ValueError("give LLM a config or its settings, not both")
        self.engine = Engine(config, loaded=loaded)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def apply_chat_template(self, prompt: str | list[dict], system: str | None = None) -> str:
        """Render one user message (or a message list) with the model's chat template."""
        return chat_prompt(self.tokenizer, self.engine.parts.model.chat_template, prompt, system)

    def _submit(self, prompts, sampling_params) -> dict[int, RequestStream]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts; give one or one each")
        streams: dict[int, RequestStream] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                for j in range(p.n):
                    req = self.engine.add_request(prompt, p.for_completion(j) if p.n > 1 else p)
                    streams[req.rid] = RequestStream(self.tokenizer, req.params, req.prompt, req.prompt_ids,
                                                     req.arrival_time, i, j)
        except Exception:
            for rid in streams:  # nothing half-submitted stays behind
                self.engine.abort(rid)
            raise
        return streams

    def stream(self, prompts: Prompt | list[Prompt], sampling_params=None) -> Iterator[StreamEvent]:
        """Submit every prompt, then yield text as each completion produces it."""
        streams = self._submit(prompts, sampling_params)
        sent = dict.fromkeys(streams, 0)
        try:
            while any(not s.finished for s in streams.values()):
                for req in self.engine.step():
                    stream = streams.get(req.rid)
                    if stream is None:
                        continue
                    event = stream.push(TokenDelta.of(req, sent[req.rid]))
                    sent[req.rid] = len(req.output_ids)
                    if stream.stop_hit:  # a stop string: finish it before the next step
                        self.engine.stop_request(req.rid, stream.output.matched_stop)
                    if event is not None:
                        yield event
        finally:
            for rid, stream in streams.items():  # a consumer that stops early must not leak pages
                if not stream.finished:
                    self.engine.abort(rid)
            self.engine.drain()  # with overlap, a step for requests that have finished may still run

    def generate(self, prompts: Prompt | list[Prompt], sampling_params=None) -> list[RequestOutput]:
        """Outputs in input order (a prompt with n > 1 gives n consecutive outputs)."""
        done: dict[tuple[int, int], RequestOutput] = {}
        for ev in self.stream(prompts, sampling_params):
            if ev.finished:
                done[(ev.index, ev.completion)] = ev.output
        return [done[k] for k in sorted(done)]

    def stats(self) -> dict:
        return self.engine.stats()
