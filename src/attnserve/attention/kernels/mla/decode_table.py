"""The MLA decode kernel and tile per GPU architecture, head count and page size: data, not code.

What is fastest depends on the shape, so the defaults are rules, first match wins, kept in `decode_table.json`
(package data). A GPU sweep rewrites it (`rules_from_sweep`, `tools/sweep_triton_mla.py --apply`) so that no
one copies numbers by hand. Each rule names a kernel ("triton", or one of the Gluon kernels of `gluon/`), its
tile, the split policy's waves and the split partials' format. Plain Python: the table is read, and a plan
resolved from it, on machines without triton or a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

from attnserve.attention.kernels.gpu_target import TileShape
from attnserve.rule_tables import package_file, read_table, write_arch_rules

TABLE_FILE = "decode_table.json"
TABLE_PACKAGE = "attnserve.attention.kernels.mla"
KERNELS = ("triton", "gluon_seesaw", "gluon_scorer", "gluon_narrow")
# the Gluon kernels' fixed tiles: (heads per CTA allowed, block_n, num_warps, num_stages), no deferred PV
GLUON_TILES = {"gluon_seesaw": ((64,), 64, 8, 2), "gluon_scorer": ((64,), 64, 8, 2), "gluon_narrow": ((16, 32), 64, 8, 2)}
# the kernels that store float16 partials (each row scaled by a power of two: attention.py says why)
SCALED_PARTIAL_KERNELS = ("gluon_scorer",)
# the Gluon kernels' latent and rope widths (DeepSeek's 512 + 64): what they are compiled for
GLUON_LATENT = 512
GLUON_ROPE = 64
# the kernels whose CTA is 64 query rows, one wgmma's M: fewer heads than that are masked rows
ROWS_64_KERNELS = tuple(k for k, (heads, *_) in GLUON_TILES.items() if heads == (64,))


@dataclass(frozen=True)
class MLADecodeConfig:
    block_h: int = 16  # query heads per program (a power of two, at least 16 for tl.dot)
    block_n: int = 32  # latent rows (keys) per pipelined tile
    num_warps: int = 4
    num_stages: int = 2
    # multiply a tile's probabilities by its latent one iteration later (decode.py says why): with 8 warps the
    # score dot is then split over both warpgroups instead of computed twice; the latent is read twice (L2)
    defer_pv: bool = False
    # the split plan's target programs per SM for this tile (SplitPolicy.waves); 0: the backend's policy. A tile
    # that fits twice on an SM over many requests wants all of its programs in one wave
    split_waves: float = 0.0
    # "triton": decode.py's kernel, any tile; the warp-specialised Hopper kernels of gluon/ have fixed tiles
    # (GLUON_TILES, the fields above must say so): "gluon_scorer" (gluon/scorer.py) 64 heads, one warpgroup scoring
    # and the other copying, both multiplying; "gluon_seesaw" (gluon/seesaw.py) 64 heads, each warpgroup its own
    # tile of a round; "gluon_narrow" (gluon/narrow.py) 16 or 32 heads as the columns of keys-major wgmmas
    kernel: str = "triton"
    # the split partials (attention.py says why): "float16", each row scaled by a power of two (the scorer kernel's
    # alone), or "float32"
    partials: str = "float32"

    def __post_init__(self):
        for name in ("block_h", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MLADecodeConfig.{name} must be a power of two >= 16, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"MLADecodeConfig.num_warps must be a power of two up to 32, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"MLADecodeConfig.num_stages must be >= 1, got {self.num_stages}")
        if self.split_waves < 0:
            raise ValueError(f"MLADecodeConfig.split_waves must be >= 0 (0: the backend's), got {self.split_waves}")
        if self.kernel not in KERNELS:
            raise ValueError(f"MLADecodeConfig.kernel must be one of {', '.join(map(repr, KERNELS))}, got "
                             f"{self.kernel!r}")
        if self.partials not in ("float32", "float16"):
            raise ValueError(f"MLADecodeConfig.partials must be 'float32' or 'float16', got {self.partials!r}")
        if self.partials != "float32" and self.kernel not in SCALED_PARTIAL_KERNELS:
            raise ValueError(f"float16 partials are the {' and '.join(SCALED_PARTIAL_KERNELS)} MLA kernels', the tile "
                             f"is {self.kernel}'s")
        if self.kernel in GLUON_TILES:
            heads, block_n, warps, stages = GLUON_TILES[self.kernel]
            if self.block_h not in heads or (self.block_n, self.num_warps, self.num_stages, self.defer_pv) != (
                    block_n, warps, stages, False):
                raise ValueError(f"the {self.kernel} MLA kernel's tile is fixed: block_h {' or '.join(map(str, heads))}"
                                 f", block_n {block_n}, {warps} warps, {stages} stages, no deferred PV")

    def for_heads(self, num_heads: int) -> MLADecodeConfig:
        """No wider head group than the model has heads (rounded up to a power of two, at least 16): a
        64-head group over 16 heads computes 48 masked rows for nothing."""
        fit = max(16, 1 << max(0, (num_heads - 1).bit_length()))
        if self.block_h <= fit or self.kernel in ROWS_64_KERNELS:
            return self
        if self.kernel == "gluon_narrow":  # heads are the wgmma's N: the narrowest that holds them
            return dataclasses.replace(self, block_h=fit)
        return dataclasses.replace(self, block_h=fit, num_warps=max(4, self.num_warps * fit // self.block_h))


@dataclass(frozen=True)
class TileRule:
    config: MLADecodeConfig
    min_heads: int = 1
    min_page_size: int = 1

    def holds(self, num_heads: int, page_size: int) -> bool:
        return num_heads >= self.min_heads and page_size >= self.min_page_size


def parse_rules(table: dict) -> dict[str, tuple[TileRule, ...]]:
    """arch -> rules from the JSON table; every arch's list must end in a rule that always holds."""
    out = {}
    for arch, rows in table["rules"].items():
        rules = tuple(TileRule(MLADecodeConfig(**r["config"]), int(r.get("min_heads", 1)),
                               int(r.get("min_page_size", 1))) for r in rows)
        if not rules or (rules[-1].min_heads, rules[-1].min_page_size) != (1, 1):
            raise ValueError(f"{TABLE_FILE}: the rules of {arch!r} must end in one with min_heads 1 and "
                             f"min_page_size 1 (a default for every shape)")
        out[arch] = rules
    if "default" not in out:
        raise ValueError(f"{TABLE_FILE}: no 'default' architecture")
    return out


@functools.cache
def shipped_rules() -> dict[str, tuple[TileRule, ...]]:
    return parse_rules(read_table(TABLE_PACKAGE, TABLE_FILE))


def tiles_for(arch: str, num_heads: int, page_size: int,
              rules: dict[str, tuple[TileRule, ...]] | None = None) -> MLADecodeConfig:
    """The first rule of `arch` (else 'default') that holds for this head count and page size."""
    rules = rules or shipped_rules()
    for rule in rules.get(arch, rules["default"]):
        if rule.holds(num_heads, page_size):
            return rule.config.for_heads(num_heads)
    raise AssertionError("every arch's rules end in one that always holds")  # pragma: no cover


# the interpreter's small MLA decode tiles; GPU tiles come from decode_table.json per arch, heads, page size
INTERPRETER_MLA_DECODE_TILES = MLADecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1)
GLUON_BLOCK_H = 64  # query rows of the 64-row Gluon kernels' CTA: one 64-row wgmma per warpgroup
# the Gluon kernel that runs MLA extend as decode rows, with one wave of splits (one CTA per SM) for the
# few-token steps that split
GLUON_ROWS_CONFIG = MLADecodeConfig(64, 64, 8, 2, split_waves=1.0, kernel="gluon_seesaw")


def mla_tile_shape(c: MLADecodeConfig, width: int, kv_lora_rank: int, itemsize: int) -> TileShape:
    """A Triton MLA decode tile's shared memory: a deferred PV buffers the previous tile's latent too."""
    return TileShape(c.block_h, width, c.block_n, width + kv_lora_rank * c.defer_pv, c.num_stages, itemsize)


def tokens_per_cta(num_heads: int) -> int:
    """Query tokens that share a 64-row CTA in extend rows: 64 / heads where heads divide 64 (16 heads: 4)."""
    return GLUON_BLOCK_H // num_heads if num_heads < GLUON_BLOCK_H and GLUON_BLOCK_H % num_heads == 0 else 1


# ---- from a sweep to the table -------------------------------------------------------------------------
CONFIG_KEYS = ("block_h", "block_n", "num_warps", "num_stages", "defer_pv", "split_waves", "kernel", "partials")
CONFIG_DEFAULTS = {"defer_pv": False, "split_waves": 0.0, "kernel": "triton", "partials": "float32"}  # what a sweep row without the key means


def rules_from_sweep(rows: list[dict], shapes: dict[str, tuple[int, int]]) -> list[dict]:
    """Table rules (JSON rows) from sweep rows `{"workload", block_h.., "us"}`; `shapes` maps a workload to
    its (heads, page size). Workloads of one (heads, page size) take the config with the best mean time
    relative to each one's fastest among configs timed on all of them; most heads and largest pages first,
    and the fewest heads' rule closes the list as the catch-all."""
    timed: dict[str, dict[tuple, float]] = {}
    for r in rows:
        r = {**CONFIG_DEFAULTS, **r}
        if "us" in r and all(k in r for k in CONFIG_KEYS) and r["workload"] in shapes and r["kernel"] in KERNELS:
            key = tuple(r[k] for k in CONFIG_KEYS)
            per = timed.setdefault(r["workload"], {})
            per[key] = min(r["us"], per.get(key, r["us"]))
    groups: dict[tuple[int, int], list[str]] = {}
    for name in timed:
        groups.setdefault(shapes[name], []).append(name)
    out = []
    for (heads, page), names in sorted(groups.items(), reverse=True):
        common = set.intersection(*(set(timed[n]) for n in names))
        if not common:
            continue

        def score(key, names=names):
            return sum(timed[n][key] / min(timed[n].values()) for n in names) / len(names)

        best = min(sorted(common), key=score)
        config = {k: v for k, v in zip(CONFIG_KEYS, best) if k not in CONFIG_DEFAULTS or v != CONFIG_DEFAULTS[k]}
        out.append({"config": config, "min_heads": heads, "min_page_size": page,
                    "measured": {n: timed[n][best] for n in sorted(names)}})
    if out:
        out[-1] = {**out[-1], "min_heads": 1, "min_page_size": 1}
    return out


def write_rules(arch: str, rules: list[dict], source: str, path: Path | None = None) -> Path:
    """Replace one architecture's rules in the table file (the package's by default); checked before writing."""
    path = write_arch_rules(path or package_file(TABLE_PACKAGE, TABLE_FILE), arch, rules, source, parse_rules)
    shipped_rules.cache_clear()
    return path


__all__ = ["GLUON_BLOCK_H", "GLUON_ROWS_CONFIG", "INTERPRETER_MLA_DECODE_TILES", "MLADecodeConfig", "TileRule",
           "mla_tile_shape", "parse_rules", "rules_from_sweep", "shipped_rules", "tiles_for", "tokens_per_cta",
           "write_rules"]
