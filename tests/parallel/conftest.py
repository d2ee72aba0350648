import pytest


@pytest.fixture(scope="module")
def ranks():
    """Two gloo ranks (spawned once per test module) that run ds4t.testing.parallel jobs."""
    from ds4t.parallel.workers import RankPool

    with RankPool(2) as pool:
        yield pool
