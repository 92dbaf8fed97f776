"""The attention-backend layer: the contract, CSR metadata, oracles, registry and backends."""

from attnserve.attention.base import AttentionBackend, BackendFeatures
from attnserve.attention.layer import AttentionLayer

__all__ = ["AttentionBackend", "AttentionLayer", "BackendFeatures"]
