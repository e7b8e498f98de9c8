"""The tiles initial values are drawn in (launcher/models/init.py), in plain Python: the planner
reads them (the memory a rank's initialisation needs beside its parameters) without importing torch.

A parameter is seen as a matrix (rows = the product of its leading dimensions, cols = its last),
cut into tiles of at most TILE_COLS columns and TILE_ELEMENTS elements.
"""

from __future__ import annotations

import math

TILE_COLS = 4096
TILE_ELEMENTS = 1 << 16


def tile_shape(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(rows, cols, tile rows, tile cols) of a parameter of `shape` seen as a matrix."""
    cols = shape[-1] if shape else 1
    rows = math.prod(shape[:-1])
    tc = min(cols, TILE_COLS)
    return rows, cols, max(1, TILE_ELEMENTS // tc), tc


def n_tiles(shape: tuple[int, ...]) -> int:
    rows, cols, tr, tc = tile_shape(shape)
    return -(-rows // tr) * -(-cols // tc)


def band_bytes(cols: int) -> int:
    """The most memory initialising a parameter with `cols` columns holds at once beside it:
    one band of tiles (a tile's rows across the box's columns) drawn in fp32, joined, and
    scaled (three copies; in host memory on a GPU, which gets the band copied in)."""
    _, _, tr, tc = tile_shape((1, cols))
    return 3 * 4 * tr * -(-cols // tc) * tc
