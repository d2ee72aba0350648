"""ds4t.kernels.embedding: exact gather, any table dtype, invariance."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4t.backend import INTERPRET
from ds4t.kernels import embedding as E
from ds4t.kernels.embedding import embedding, embedding_ref
from tests.kernels.invariance import assert_rows_invariant, poisoned

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {dt: dict(atol=0.0, rtol=0.0) for dt in DTYPES}  # a gather and an exact upcast


@pytest.fixture(params=["gpu-tiles", "interp-tiles"])
def tiles(request):
    if request.param == "gpu-tiles":
        with E.EMBEDDING_CONFIGS.forced(lambda D: E._embedding_config(D, block_r=1, max_block_d=128)):
            yield request.param
    else:
        yield request.param


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("idt", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("B,V,D", [(1, 5, 1), (7, 100, 333), (33, 257, 130)])
def test_matches_reference(device, tiles, dt, idt, B, V, D):
    g = torch.Generator(device="cpu").manual_seed(0)
    table = torch.randn(V, D, generator=g).to(dt).to(device)
    ids = torch.randint(0, V, (B,), generator=g).to(idt).to(device)
    ids[0] = V - 1  # the last row of the table
    out = poisoned((B, D), device=device)
    y = embedding(ids, table, out=out)
    assert y is out
    torch.testing.assert_close(y, embedding_ref(ids, table), **TOL[dt])


def test_repeated_ids_and_bad_args(device):
    table = torch.randn(10, 6, device=device)
    ids = torch.tensor([3, 3, 0, 9, 3], device=device)
    assert torch.equal(embedding(ids, table), table[ids])
    with pytest.raises(ValueError):
        embedding(ids.float(), table)
    with pytest.raises(ValueError):
        embedding(ids.view(1, -1), table)


POOL, V_INV, D_INV = 40, 97, 333


@st.composite
def batches(draw):
    B = draw(st.integers(1, 33))
    rows = draw(st.permutations(range(POOL)))[:B]
    return rows, draw(st.integers(0, B - 1))


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=batches(), dt=st.sampled_from(DTYPES))
def test_rows_invariant(batch, dt):
    device = torch.device("cpu") if INTERPRET else torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(8)
    table = torch.randn(V_INV, D_INV, generator=g).to(dt).to(device)
    ids = torch.randint(0, V_INV, (POOL,), generator=g).to(device)
    assert_rows_invariant(lambda i: embedding(ids[i], table), *batch)
