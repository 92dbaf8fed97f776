"""KV-cache dtype names (SGLang's `--kv-cache-dtype` spellings) -> torch dtypes: the table is attnserve.dtypes'."""

from __future__ import annotations

from attnserve.dtypes import FP8_DTYPES, KV_DTYPES, canonical_kv_dtype, dtype_bytes, parse_kv_dtype

__all__ = ["FP8_DTYPES", "KV_DTYPES", "canonical_kv_dtype", "dtype_bytes", "parse_kv_dtype"]
