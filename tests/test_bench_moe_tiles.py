"""bench/moe_tiles.py's timing rotation on the CPU: a launch whose experts fit the L2 is timed over enough
other routings that the weights read exceed 4x the L2 (a decode step reads its experts from DRAM)."""
from tests.bench_scripts import load


def test_rotations_cover_four_l2s_of_weights():
    mt = load("bench/moe_tiles.py", "moe_tiles_rotations")
    l2 = 50 * 2**20
    assert mt.rotations(36e6, l2) == 6            # Qwen3-Next at one row: 36 MB of its experts
    assert mt.rotations(36e6, l2) * 36e6 >= 4 * l2 > (mt.rotations(36e6, l2) - 1) * 36e6
    assert mt.rotations(219e6, l2) == 1           # GLM-4.5 at one row already reads 219 MB
    assert mt.rotations(1e3, l2) == 16 and mt.rotations(1e3, l2, most=4) == 4
    assert mt.rotations(0, l2) == 16              # never a division by zero
