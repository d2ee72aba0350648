"""ds4t.sampling: the public sampler over the batch-invariant kernel — same bits as the kernel, a row's
token independent of the batch, validation, and the greedy floor for tiny temperatures."""
import warnings

import numpy as np
import pytest
import torch

from ds4t import sampling
from ds4t.kernels import sampling as kernel

B, V = 6, 256


@pytest.fixture(scope="module")
def logits():
    """On the kernels' device (the sampler keeps the logits' device; the GPU kernel needs CUDA)."""
    from ds4t.backend import default_device

    g = torch.Generator().manual_seed(3)
    return (torch.randn(B, V, generator=g) * 3).to(default_device())


PARAMS = dict(temperature=[0.0, 1.0, 0.7, 1.3, 2.0, 0.9], top_k=[0, 0, 5, 40, 0, 20],
              top_p=[1.0, 1.0, 1.0, 0.8, 0.5, 0.95], seed=[1, 2, 3, -4, 2 ** 64 + 5, 1], position=[0, 3, 9, 9, 100, 7])


def test_same_bits_as_the_kernel_with_seed_derived_streams(logits):
    p = PARAMS
    dev = logits.device
    want = kernel.sample(
        logits, torch.tensor([sampling.to_int64(s) for s in p["seed"]], device=dev),
        torch.tensor([sampling.stream_id(s) for s in p["seed"]], device=dev), torch.tensor(p["position"], device=dev),
        torch.tensor(p["temperature"], device=dev), torch.tensor(p["top_k"], dtype=torch.int32, device=dev),
        torch.tensor(p["top_p"], device=dev))
    got = sampling.sample(logits, **p)
    assert got.dtype == torch.int64 and got.shape == (B,) and torch.equal(got, want)
    # scalars broadcast; numpy and tensor parameters are accepted
    one = sampling.sample(logits, temperature=np.float32(0.8), top_k=np.int64(10), seed=7, position=torch.tensor(5))
    assert torch.equal(one, sampling.sample(logits, temperature=[0.8] * B, top_k=[10] * B, seed=[7] * B, position=[5] * B))


def rows_match_alone(sampler, logits, params):
    """Does every row get the same token in the batch as alone (row i in a batch of 1)?"""
    batch = sampler(logits, **params)
    return all(int(sampler(logits[i:i + 1], **{k: [v[i]] for k, v in params.items()})[0]) == int(batch[i])
               for i in range(len(logits)))


def test_a_rows_token_does_not_depend_on_the_batch(logits):
    assert rows_match_alone(sampling.sample, logits, PARAMS)
    # the same row at another index of a larger batch
    perm = [3, 0, 5, 1, 4, 2]
    permuted = sampling.sample(logits[perm], **{k: [v[i] for i in perm] for k, v in PARAMS.items()})
    assert torch.equal(permuted, sampling.sample(logits, **PARAMS)[perm])


def test_negative_control_a_batch_dependent_sampler_is_caught(logits):
    """A sampler whose stream is the row's index in the batch (as a slot-seeded server would do)."""
    def by_row(lg, **p):
        return sampling.sample(lg, **p, stream=list(range(len(lg))))

    assert not rows_match_alone(by_row, logits, {**PARAMS, "temperature": [1.0] * B})


# Pinned: the bits every seeded request has been drawn with (the server's streams before this module
# existed). A change here changes what a seed produces.
PINNED = [(0, 7070836379803831727, 0), (1, 1227844342346046657, 1), (42, 4456085495900499605, 42),
          (-1, 7266964230113668128, -1), (2 ** 63, 5196802822362493915, -(2 ** 63)),
          (2 ** 64 + 3, 2092789425003139053, 3)]


def test_stream_id_and_to_int64_keep_their_bits():
    for s, stream, s64 in PINNED:
        assert sampling.stream_id(s) == stream and sampling.to_int64(s) == s64
    for s in (0, 1, 42, -1, -(2 ** 63), 2 ** 63, 2 ** 64 - 1, 123456789012345678901234567890):
        assert 0 <= sampling.stream_id(s) < 2 ** 63 and -(2 ** 63) <= sampling.to_int64(s) < 2 ** 63
    assert sampling.stream_id(1) != sampling.stream_id(2)


def test_temperatures_below_the_floor_are_greedy(logits):
    # the kernel itself at a subnormal temperature: logits / t overflows and the draw is not the argmax
    dev = logits.device
    t = torch.full((B,), 1e-40, device=dev)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's numpy reports the overflow
        raw = kernel.sample(logits, torch.zeros(B, dtype=torch.int64, device=dev), torch.arange(B, device=dev),
                            torch.zeros(B, dtype=torch.int64, device=dev), t,
                            torch.zeros(B, dtype=torch.int32, device=dev), torch.ones(B, device=dev))
    assert not torch.equal(raw, kernel.argmax(logits))
    for temp in (0.0, 1e-40, sampling.MIN_TEMPERATURE * 0.99):
        assert torch.equal(sampling.sample(logits, temperature=temp, seed=5), kernel.argmax(logits))


def test_the_floor_itself_samples(logits):
    """Two tied maxima: greedy always takes the first; at MIN_TEMPERATURE the seed picks between them."""
    x = torch.zeros(16, V, device=logits.device)
    x[:, 10] = x[:, 20] = 5.0
    seeds = list(range(16))
    below = sampling.sample(x, temperature=sampling.MIN_TEMPERATURE * 0.99, seed=seeds)
    at = sampling.sample(x, temperature=sampling.MIN_TEMPERATURE, seed=seeds)
    assert below.tolist() == [10] * 16 and set(at.tolist()) == {10, 20}


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(temperature=True), "temperature must be"),
    (dict(top_k=-1), r"top_k must be an int in \[0, 256\]"),
    (dict(top_k=257), r"top_k must be an int in \[0, 256\]"),
    (dict(top_k=2.0), "top_k must be an int"),
    (dict(top_p=0.0), r"top_p must be a number in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be a number in \(0, 1\]"),
    (dict(top_p=float("nan")), "top_p must be"),
    (dict(seed=1.5), "seed must be an int"),
    (dict(position=-1), "position must be an int"),
    (dict(temperature=[1.0, 1.0]), "temperature has 2 values for 6 rows"),
    (dict(top_k=np.zeros((6, 1), dtype=np.int64)), "top_k must be a scalar or 1-D"),
    (dict(temperature=[1.0, 1.0, -1.0, 1.0, 1.0, 1.0]), "row 2: temperature"),
])
def test_invalid_parameters_are_named(logits, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sampling.sample(logits, **kwargs)


def test_logits_must_be_a_2d_float_tensor():
    with pytest.raises(ValueError, match="logits must be a float tensor"):
        sampling.sample(torch.zeros(V))
    with pytest.raises(ValueError, match="logits must be a float tensor"):
        sampling.sample(torch.zeros(2, V, dtype=torch.int64))
