"""What every model offers the engine: its attention shape and a forward over a ForwardBatch.

The engine builds the KV pool from `model.kv_cache_spec()` (an `AttentionShape`,
derived from the model's parsed config) before the first step, then calls
`model(input_ids [T], positions [T], fb, logits_indices=None)` for every step;
with `logits_indices` only those rows of the hidden states reach the LM head
(the last token of each request is all sampling needs).
"""

from __future__ import annotations

import torch
from torch import nn

from attnserve.batch import ForwardBatch
from attnserve.distributed.embedding import ParallelLMHead, VocabParallelEmbedding
from attnserve.distributed.state import parallel_state
from attnserve.models.config import attention_shape_of
from attnserve.models.layers import RMSNorm
from attnserve.ops import TORCH_OPS, OpSet
from attnserve.shape import AttentionShape


class CausalLM(nn.Module):
    """The decoder-only skeleton every model shares: embeddings, layers, final norm, LM head.

    Subclasses build `embed_tokens`, `rotary`, `layers`, `norm` and `lm_head`; each layer is
    called as `layer(positions, hidden, residual, fb, rope) -> (hidden, residual)`: the residual
    add is left to the next norm so the two run as one fused op (`ops`, set by `use_ops`).
    """

    ops: OpSet = TORCH_OPS
    tp_size: int = 1  # tensor-parallel ranks the layers were built for (set by _build_stack)

    def _build_stack(self, cfg, rotary: nn.Module, make_layer) -> None:
        """Embeddings, `make_layer(cfg, layer_id, rotary)` per layer, final norm, LM head (tied if asked)."""
        self.config = cfg
        self.tp_size = parallel_state().size  # the tensor-parallel ranks this model's layers were built to share the work with
        self.rotary = rotary
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(make_layer(cfg, i, rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def kv_cache_spec(self) -> AttentionShape:
        """What the KV pool must hold and what attention sees: the parsed config's attention shape, as this
        tensor-parallel rank holds it (its query and KV heads; MLA's latent whole)."""
        return attention_shape_of(self.config, self.tp_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        fb: ForwardBatch,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [T], positions [T] -> logits [T, vocab] (or [len(logits_indices), vocab]), float32."""
        hidden, residual = self.forward_hidden(input_ids, positions, fb)
        return self.compute_logits(hidden, logits_indices, residual)

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers without the final norm and LM head: (the last layer's output, the residual stream) `[T,
        hidden]` each, which `compute_logits` finishes."""
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rotary.step(positions, hidden.dtype, self.ops.rope_store)  # cos/sin once for every layer
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, fb, rope)
        return hidden, residual

    def compute_logits(
        self, hidden: torch.Tensor, logits_indices: torch.Tensor | None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The final norm (after adding the residual stream, when given) and the LM head on the picked rows."""
        if logits_indices is not None:
            hidden = hidden[logits_indices]
            residual = residual[logits_indices] if residual is not None else None
        hidden = self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]
        return self.lm_head(hidden).float()  # [T or len(logits_indices), vocab]
