"""Token ids may be Python ints, numpy integers or integer arrays/tensors; bools and floats are refused."""
import numpy as np
import pytest
import torch

import ds4t
from ds4t import BatchError, DecodeItem, eval_batch
from ds4t.batch.session import as_token_list


@pytest.fixture(scope="module")
def model():
    return ds4t.load("tiny-qwen")


@pytest.mark.parametrize("tokens", [np.int64(7), np.int32(7), np.uint8(7), [np.int64(7)], (np.int32(7),),
                                    np.array([7]), np.array(7, dtype=np.int16), torch.tensor([7])])
def test_integer_kinds_become_python_ints(tokens):
    out = as_token_list(tokens, 256, "t")
    assert out == [7] and type(out[0]) is int


@pytest.mark.parametrize("tokens", [True, np.bool_(True), [np.True_], np.array([1.0]), np.float64(3.0), [np.float32(3)],
                                    np.array([True]), np.zeros((1, 2), dtype=np.int64), torch.tensor([True]),
                                    "7", None])
def test_bools_floats_and_others_are_refused(tokens):
    with pytest.raises(BatchError, match="^t: token"):
        as_token_list(tokens, 256, "t")


def test_numpy_tokens_outside_the_vocabulary_are_named():
    with pytest.raises(BatchError, match="t: token 256 outside the vocabulary"):
        as_token_list(np.array([3, 256]), 256, "t")


def test_numpy_prompt_and_decode_token_give_the_same_bits(model):
    a, b = model.new_session(16), model.new_session(16)
    la = a.prefill([5, 6, 7])
    lb = b.prefill(np.array([5, 6, 7], dtype=np.int32))
    assert torch.equal(la, lb) and b.tokens == [5, 6, 7] and all(type(t) is int for t in b.tokens)
    ra = eval_batch([DecodeItem(a, 9)])
    rb = eval_batch([DecodeItem(b, np.int64(9))])
    assert torch.equal(ra.logits, rb.logits) and type(b.tokens[-1]) is int
    with pytest.raises(BatchError, match=r"item 0: token .*True.* is not an int"):
        eval_batch([DecodeItem(b, np.bool_(True))])
