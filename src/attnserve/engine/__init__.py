"""The engine: continuous batching over the paged KV cache, prefix cache, CUDA graphs, sampling,
speculative decoding.

`LLM` is the offline API, `EngineLoop` steps the engine for streaming consumers (the server's engine
process runs it), `SamplingParams` says how each request picks tokens and stops.
"""

from attnserve.engine.config import EngineConfig
from attnserve.engine.engine import Engine
from attnserve.engine.llm import LLM
from attnserve.engine.loop import EngineLoop
from attnserve.engine.outputs import RequestOutput, StreamEvent
from attnserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "EngineLoop", "RequestOutput", "SamplingParams", "StreamEvent"]
