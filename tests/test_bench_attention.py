"""bench/bench_attention.py's MLA compute ceiling (what its --mla-heads rows are read against)."""
from tests.bench_scripts import load

ba = load("bench/bench_attention.py", "bench_attention")


def test_mla_ceiling_is_compute_bound_with_many_heads_and_bytes_bound_with_few():
    """DeepSeek-V3's latent (512 + 64): 128 heads spend ~242 FLOP a cached byte -- at 780 TFLOP/s and 4.2 TB/s
    the MMAs cap the cache's stream near 77 % of copy bandwidth -- while a tensor-parallel rank of 16 heads
    (~30 FLOP a byte) is bound by its bytes alone."""
    peak, bw = 780e12, 4.2e12
    per_byte, ceiling = ba.mla_copy_ceiling(128, 512, 64, peak, bw)
    assert abs(per_byte - 128 * 1088 / 576) < 1e-9 and 0.76 < ceiling < 0.78
    per_byte, ceiling = ba.mla_copy_ceiling(16, 512, 64, peak, bw)
    assert abs(per_byte - 16 * 1088 / 576) < 1e-9 and ceiling == 1.0
