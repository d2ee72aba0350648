import pytest
import torch
from hypothesis import HealthCheck, settings

import ds4t  # noqa: F401  (selects the backend before triton is imported)
from ds4t.backend import default_device

# Kernels run in the Triton interpreter on the CPU: examples are slow, never time them out.
settings.register_profile("ds4t", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile("ds4t")


@pytest.fixture
def device():
    return default_device()


def pytest_configure(config):
    torch.manual_seed(0)


@pytest.fixture
def on_kernel_device():
    """Tensors made without a device land on the kernels' device for the test's duration."""
    prev = torch.get_default_device()
    torch.set_default_device(default_device())
    yield default_device()
    torch.set_default_device(prev)
