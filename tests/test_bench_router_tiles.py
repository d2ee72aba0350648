"""bench/router_tiles.py: the tiles it times keep the router's split columns (so its bits on the GPU)."""
import dataclasses

from ds4t.kernels import linear as L
from tests.bench_scripts import load

rt = load("bench/router_tiles.py", "router_tiles")


def test_same_split_tiles_keep_every_split():
    for _, K, N in rt.SHAPES:
        base = L._gpu_heuristic(K, N, 4)
        tiles = rt.same_split_tiles(base, K)
        assert tiles[0] == {} and len(tiles) > 20
        assert all(dataclasses.replace(base, **f).k_per_split(K) == base.k_per_split(K) for f in tiles)
        # the control: a tile whose K step moves a split boundary is left out
        wide = dataclasses.replace(base, block_k=256)
        assert wide.k_per_split(K) != base.k_per_split(K)
        assert {"block_k": 256} not in [{k: v for k, v in f.items() if k == "block_k"} for f in tiles]


def test_per_head_tiles_are_unsplit_bf16_tiles():
    for _, G, N, K in rt.HEADS:
        base = L._gpu_heuristic(K, N, 2)
        tiles = rt.same_split_tiles(base, K, rt.HEADS_GRID)
        assert tiles[0] == {} and len(tiles) > 40
        assert all(dataclasses.replace(base, **f).k_per_split(K) == base.k_per_split(K) for f in tiles)
