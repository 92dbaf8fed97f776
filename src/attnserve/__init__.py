"""attnserve: pluggable attention backends over a paged KV cache, and the engine around them."""

__version__ = "0.1.0"
