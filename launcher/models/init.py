"""Initial weights as a function of the parameter and the seed alone, computable shard by shard.

Every parameter is seen as a matrix cut into tiles (launcher/models/tiles.py). Each tile is drawn
from its own generator, seeded with the seed and the tile's number in the whole model (the
parameters in the order the full model lists them, each tile after the one before). A rank
holding a box of a parameter (rows and columns of its shard, from any mix of FSDP, tensor and
expert sharding) draws the tiles that box touches and keeps their overlap: the same values
wherever they are drawn, on one process or on any layout, with time and memory in proportion to
the rank's share (a tile's width at most, where its shard is narrower than a tile).

A parameter's distribution comes from its family's `init_rule(name)` (launcher/models/llama.py,
launcher/models/gpt.py); a tied parameter listed a second time is drawn as the first (`aliases`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from launcher.models.tiles import n_tiles, tile_shape

# torch's CPU generator (mt19937) keeps 32 bits of its seed: tile numbers are mixed with an odd
# multiplier, one-to-one onto those 32 bits (4 billion tiles, 280 trillion parameters).
_MIX = 0x9E3779B1
_MASK32 = (1 << 32) - 1


@dataclass(frozen=True)
class Rule:
    """How a parameter starts: normal(0, std), or every element `value` (std None)."""

    std: float | None = None
    value: float = 0.0


def normal(std: float) -> Rule:
    return Rule(std=std)


ONES, ZEROS = Rule(value=1.0), Rule(value=0.0)


def _seed32(seed: int) -> int:
    """splitmix64 of the run's seed, cut to 32 bits: the offset every tile number is mixed with."""
    z = (seed + 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK32


@dataclass(frozen=True)
class Plan:
    """What a model's initialisation needs from its full (unsplit, unsharded) form: each
    parameter's first tile number and global shape, and the names that alias another."""

    first_tile: dict[str, int]
    shapes: dict[str, tuple[int, ...]]
    aliases: dict[str, str]

    @classmethod
    def of(cls, model: nn.Module) -> Plan:
        """From the full model (on the meta device costs nothing); names as it lists them."""
        first, shapes, aliases, seen, tile = {}, {}, {}, {}, 0
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                aliases[name] = seen[id(p)]
                continue
            seen[id(p)] = name
            first[name], shapes[name] = tile, tuple(p.shape)
            tile += n_tiles(tuple(p.shape))
        return cls(first, shapes, aliases)

    def canonical(self, name: str) -> str:
        return self.aliases.get(name, name)


@torch.no_grad()
def fill_box(
    out: torch.Tensor,
    rule: Rule,
    seed: int,
    first_tile: int,
    shape: tuple[int, ...],
    offsets: tuple[int, ...],
) -> None:
    """Write into `out` (the box of a parameter of global `shape` starting at `offsets`, shaped
    as the box) the values the whole parameter holds there."""
    if out.numel() == 0:
        return
    if rule.std is None:
        out.fill_(rule.value)
        return
    rows, cols, tr, tc = tile_shape(shape)
    sizes = tuple(out.shape) or (1,)
    offsets = tuple(offsets) or (0,)
    shape = shape or (1,)
    # The box's rows in the matrix view, in the order its local tensor holds them.
    row_ids = torch.zeros((), dtype=torch.int64)
    for dim, n in enumerate(shape[:-1]):
        row_ids = row_ids.unsqueeze(-1) * n + torch.arange(offsets[dim], offsets[dim] + sizes[dim])
    row_ids = row_ids.reshape(-1)
    c0, c1 = offsets[-1], offsets[-1] + sizes[-1]
    col_tiles = range(c0 // tc, (c1 - 1) // tc + 1)
    n_col_tiles = -(-cols // tc)
    # Written a band of tiles at a time: the transient is one band, not the box.
    view = out.view(row_ids.numel(), c1 - c0)
    gen, mix = torch.Generator(), _seed32(seed)
    # The box's rows ascend (a product of ascending ranges): each tile's are one run of them.
    tiles, counts = torch.unique_consecutive(row_ids // tr, return_counts=True)
    at = 0
    for row_tile, count in zip(tiles.tolist(), counts.tolist(), strict=True):
        start = row_tile * tr
        height = min(tr, rows - start)
        drawn = []
        for col_tile in col_tiles:
            number = first_tile + row_tile * n_col_tiles + col_tile
            gen.manual_seed((number * _MIX + mix) & _MASK32)
            drawn.append(torch.randn(height, min(tc, cols - col_tile * tc), generator=gen))
        band = drawn[0] if len(drawn) == 1 else torch.cat(drawn, dim=1)
        band = band[:, c0 - col_tiles[0] * tc : c1 - col_tiles[0] * tc]
        first, last = row_ids[at].item() - start, row_ids[at + count - 1].item() - start
        if last - first == count - 1:  # contiguous rows (no shard inside the tile's rows)
            band = band[first : last + 1]
        else:
            band = band[row_ids[at : at + count] - start]
        view[at : at + count].copy_(band * rule.std)
        at += count


@torch.no_grad()
def init_whole(model: nn.Module, seed: int, rule_of) -> None:
    """Every parameter of an unsharded, unsplit model, as the sharded path gives them."""
    plan = Plan.of(model)
    for name, p in model.named_parameters():
        fill_box(p, rule_of(name), seed, plan.first_tile[name], tuple(p.shape), (0,) * p.ndim)
