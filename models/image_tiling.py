"""The released Nemotron Nano VL V2 image format: square tiles plus a thumbnail.

An image is resized to `cols x rows` tiles of `tile_size` pixels, the
arrangement (at most `max_num_tiles` tiles) whose aspect ratio is closest to
the image's own; the tiles are cut row-major, and when there is more than one
a thumbnail (the whole image resized to one tile) follows them. The vision
tower encodes each tile on its own, so every tile gives the same number of
embeddings:

    image 1000 x 500 px, tile 448   ->  2 x 1 tiles + thumbnail
    +---------+---------+   +---------+
    | tile 0  | tile 1  |   |  thumb  |    3 tiles x (448/16)^2 / 2^2 tokens
    +---------+---------+   +---------+

The prompt holds `<img>` + one `<image>` per embedding of every tile + `</img>`.
"""

from __future__ import annotations


def tile_arrangement(
    height: int, width: int, tile_size: int, max_num_tiles: int
) -> tuple[int, int]:
    """`(rows, cols)` of tiles for an image of `height` x `width` pixels.

    Candidates are every `cols x rows` with at most `max_num_tiles` tiles, fewest
    tiles first; the one whose `cols / rows` is closest to `width / height`
    wins. On an exact tie a later (larger) candidate wins only when the image
    has more than half the pixels of that many tiles, so a small image is not
    blown up into many tiles of the same shape.
    """
    if height < 1 or width < 1:
        raise ValueError(f"an image needs positive sides, got {width} x {height}")
    candidates = sorted(
        {
            (cols, rows)
            for cols in range(1, max_num_tiles + 1)
            for rows in range(1, max_num_tiles // cols + 1)
        },
        key=lambda c: (c[0] * c[1], c),
    )
    aspect = width / height
    best, best_gap = (1, 1), float("inf")
    for cols, rows in candidates:
        gap = abs(aspect - cols / rows)
        if gap < best_gap:
            best, best_gap = (cols, rows), gap
        elif gap == best_gap and height * width > 0.5 * tile_size**2 * cols * rows:
            best = (cols, rows)
    return best[1], best[0]


def num_tiles(rows: int, cols: int, use_thumbnail: bool) -> int:
    """Tiles the tower encodes: the grid's, plus the thumbnail of a multi-tile image."""
    return rows * cols + (1 if use_thumbnail and rows * cols > 1 else 0)
