"""ds4t.step: one step's metadata in one host->device copy, and the views a model reads from it."""
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4t.step import SegmentSpec, StepBatch


def test_layout_of_a_mixed_step():
    """Decode rows, a prefill chunk, a kept verify chunk and hidden rows: every view reads its own part
    of the one meta tensor, and the multi-token segments' table is (first row, rows, slot, states row)."""
    b = StepBatch.build([
        (3, [11], 7),                                            # decode: slot 3, one token at position 7
        SegmentSpec(5, [1, 2, 3, 4], 0, all_logits=True),         # prefill chunk of 4
        (0, [21], 2),                                            # decode
        SegmentSpec(6, [8, 9, 10], 12, hidden=True, keep=True),  # verify chunk of 3, kept, hidden rows
    ], "cpu")
    assert b.tokens.tolist() == [11, 1, 2, 3, 4, 21, 8, 9, 10]
    assert b.positions.tolist() == [7, 0, 1, 2, 3, 2, 12, 13, 14]
    assert b.slots.tolist() == [3, 5, 5, 5, 5, 0, 6, 6, 6]
    assert b.out_rows.tolist() == [0, 1, 2, 3, 4, 5, 8]
    assert b.single_rows.tolist() == [0, 5]
    assert b.hidden_rows.tolist() == [6, 7, 8]
    assert b.multi_segments.tolist() == [[1, 4, 5, -1], [6, 3, 6, 0]]   # the kept chunk's states from row 0
    assert [s.states_row for s in b.segments] == [-1, -1, -1, 0]
    assert not b.all_single and (b.shortest_run, b.longest_run) == (3, 4)   # the attention kernels' runs hint


def test_a_decode_step_has_no_segment_table():
    b = StepBatch.build([(0, [5], 3), (1, [6], 9)], "cpu")
    assert b.all_single and b.multi_segments is None and b.hidden_rows is None
    assert b.shortest_run == b.longest_run == 0
    meta, n, o, segs, h = StepBatch.host_meta([(0, [5], 3), (1, [6], 9)])
    # a graph's static buffer: tokens, out rows, single rows, then positions / slots / lengths as int32 pairs
    assert meta.numel() == n + o + 2 + (3 * n + 1) // 2 and h == 0
    b = StepBatch.from_meta(meta, n, o, segs, h)
    assert b.lengths.tolist() == [4, 10] and b.positions.dtype == b.slots.dtype == b.lengths.dtype == torch.int32


def test_segment_table_is_a_view_of_the_one_copy():
    meta, n, o, segs, h = StepBatch.host_meta([SegmentSpec(2, [1, 2], 0), (4, [3], 5)])
    b = StepBatch.from_meta(meta, n, o, segs, h)
    # after tokens (3), out rows (2), single rows (1): the one multi-token segment's (first row, rows, slot, -1)
    assert b.multi_segments.data_ptr() == meta[6:].data_ptr() and b.multi_segments.dtype == torch.int64
    assert b.multi_segments.tolist() == [[0, 2, 2, -1]]


def test_kept_chunks_get_consecutive_states_rows():
    """Two kept chunks around a prompt chunk: their states rows count the kept rows only (0, then 3)."""
    b = StepBatch.build([SegmentSpec(1, [1, 2, 3], 4, keep=True), (2, [5] * 6, 0),
                         SegmentSpec(3, [7, 8], 9, keep=True), SegmentSpec(4, [9], 1, keep=True)], "cpu")
    assert [s.states_row for s in b.segments] == [0, -1, 3, -1]   # a one-token segment keeps nothing
    assert b.multi_segments[:, 3].tolist() == [0, -1, 3]


def test_every_view_shares_the_one_buffer():
    """Positions, slots and lengths are int32 views of the one meta buffer: a step's device copy needs no
    kernel to convert or derive them (an odd row count leaves one pad half-word)."""
    meta, n, o, segs, h = StepBatch.host_meta([(0, [5], 3), (1, [6], 9), (7, [2], 0)])
    b = StepBatch.from_meta(meta, n, o, segs, h)
    lo, hi = meta.data_ptr(), meta.data_ptr() + meta.numel() * meta.element_size()
    for t in (b.tokens, b.positions, b.slots, b.lengths, b.out_rows, b.single_rows):
        assert lo <= t.data_ptr() < hi
    assert (b.positions.tolist(), b.slots.tolist(), b.lengths.tolist()) == ([3, 9, 0], [0, 1, 7], [4, 10, 1])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 63), st.integers(0, 150000), st.integers(0, 1 << 20)), min_size=1,
                max_size=300))
def test_decode_meta_is_host_meta_of_a_decode_step(rows):
    """The replay path's metadata (no Segment objects, written in place) is host_meta's, word for word, at
    every batch size (odd and even row counts: the padding half-word), also past the cached row ranges."""
    segments = [(slot, [tok], pos) for slot, tok, pos in rows]
    meta = StepBatch.host_meta(segments)[0].numpy()
    assert np.array_equal(StepBatch.decode_meta(segments), meta)
    buf = np.full(StepBatch.decode_meta_len(len(rows)), -7, dtype=np.int64)   # stale words must all go
    out = StepBatch.decode_meta(segments, out=buf)
    assert out is buf and np.array_equal(buf, meta)


def test_decode_meta_control_a_wrong_word_is_seen():
    """Negative control for the property above: one changed position makes the arrays differ."""
    segments = [(0, [5], 3), (1, [6], 9), (2, [7], 11)]
    meta = StepBatch.host_meta(segments)[0].numpy()
    assert not np.array_equal(StepBatch.decode_meta([(0, [5], 3), (1, [6], 9), (2, [7], 12)]), meta)
