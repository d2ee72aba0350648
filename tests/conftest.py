import os

import pytest
import torch

import ds4t  # noqa: F401  (selects the backend before triton is imported)
from ds4t.backend import default_device


@pytest.fixture
def device():
    return default_device()


def pytest_configure(config):
    torch.manual_seed(0)
    os.environ.setdefault("HYPOTHESIS_PROFILE", "ci")
