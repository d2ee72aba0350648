import sys

import pytest
import torch

# The ds4t pytest plugin: hypothesis profile, ds4t_device / on_kernel_device / ds4t_model fixtures.
# Registered here for a checkout that is not installed; an installed ds4t loads it by entry point.
from ds4t.testing import plugin as ds4t_plugin


def pytest_configure(config):
    # HF's Qwen3-Next oracle runs on the CPU, so its gated delta rule must take its torch forms. Some
    # transformers releases send the rule to flash-linear-attention whenever that package imports, whatever
    # the tensors' device: on a GPU machine with fla installed, fla's kernels got the oracle's CPU tensors and
    # failed ("cannot be accessed from Triton (cpu tensor?)"). No test uses fla itself (the GPU benches'
    # HF peers do, in their own processes), so the test process does not import it.
    if "fla" not in sys.modules:
        sys.modules["fla"] = None
    if not config.pluginmanager.is_registered(ds4t_plugin):
        config.pluginmanager.register(ds4t_plugin, "ds4t.testing.plugin")
    torch.manual_seed(0)


# The few tests that take minutes in the Triton interpreter, run first: collected in path order they came
# last (tests/test_*.py after every sub-folder) and one worker ran them alone while the other sat idle.
# With `-n 2 --dist worksteal` (make test) they start at once and the rest of the suite balances around them.
SLOW_FIRST = ("tests/test_gpu_compile.py::test_model_kernels_compile_for_the_gpu",
              "tests/models/test_real_gguf.py::")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        return next((i for i, p in enumerate(SLOW_FIRST) if item.nodeid.startswith(p)), len(SLOW_FIRST))

    items.sort(key=rank)   # stable: every other test keeps its collected order


@pytest.fixture
def device(ds4t_device):
    return ds4t_device

