import pytest
import torch

# The ds4t pytest plugin: hypothesis profile, ds4t_device / on_kernel_device / ds4t_model fixtures.
# Registered here for a checkout that is not installed; an installed ds4t loads it by entry point.
from ds4t.testing import plugin as ds4t_plugin


def pytest_configure(config):
    if not config.pluginmanager.is_registered(ds4t_plugin):
        config.pluginmanager.register(ds4t_plugin, "ds4t.testing.plugin")
    torch.manual_seed(0)


@pytest.fixture
def device(ds4t_device):
    return ds4t_device
