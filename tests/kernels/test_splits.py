"""Split schedules of the decode attention kernels: the host rule, its in-kernel twin, the grid bound."""
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4t.kernels.splits import SplitSchedule, as_schedule, split_of

pytestmark = pytest.mark.usefixtures("on_kernel_device")

schedules = st.builds(
    lambda lo, k, t: SplitSchedule(lo, lo << k, t),
    st.sampled_from([1, 4, 16, 64]), st.integers(0, 6), st.integers(1, 40))


@triton.jit
def _split_of_kernel(len_ptr, out_ptr, N, MIN_SPLIT: tl.constexpr, SPLIT_STEPS: tl.constexpr,
                     TARGET_SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    n = tl.load(len_ptr + i, mask=i < N, other=0)
    tl.store(out_ptr + i, split_of(n, MIN_SPLIT, SPLIT_STEPS, TARGET_SPLITS), mask=i < N)


@settings(max_examples=25, deadline=None)
@given(s=schedules, L=st.integers(1, 5000))
def test_rule_and_grid_bound(s, L):
    """split_of is the documented rule (a power-of-two multiple of min_split, the first whose
    target_splits copies cover the row, capped at max_split) and max_splits(L) is the most splits any
    row of 1..L positions has."""
    for n in {1, 2, L // 3 + 1, L // 2 + 1, L}:
        sp = s.split_of(n)
        assert s.min_split <= sp <= s.max_split and (sp // s.min_split) & (sp // s.min_split - 1) == 0
        assert sp == s.max_split or sp * s.target_splits >= n
        assert sp == s.min_split or (sp // 2) * s.target_splits < n
    assert s.max_splits(L) == max(triton.cdiv(n, s.split_of(n)) for n in range(1, L + 1))


def test_kernel_twin_equals_host_rule(device):
    lengths = torch.arange(0, 3000, 7, dtype=torch.int32)
    for s in (SplitSchedule(64, 2048, 32), SplitSchedule(16, 64, 2), SplitSchedule.fixed(48)):
        out = torch.full_like(lengths, -1).to(device)
        _split_of_kernel[(1,)](lengths.to(device), out, lengths.numel(), **s.kernel_args(),
                               BLOCK=triton.next_power_of_2(lengths.numel()))
        assert out.cpu().tolist() == [s.split_of(int(n)) for n in lengths]


def test_as_schedule_and_bad_schedules():
    d = SplitSchedule(64, 2048, 32)
    assert as_schedule(None, d) is d and as_schedule(d, None) is d
    assert as_schedule(48, d) == SplitSchedule(48, 48, 1)
    for bad in [(0, 16, 1), (32, 16, 1), (16, 48, 1), (16, 64, 0)]:
        with pytest.raises(ValueError):
            SplitSchedule(*bad)
