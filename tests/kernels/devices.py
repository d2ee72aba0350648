"""Test inputs on the kernels' device: the GPU when there is one, else the CPU (interpreter).

Modules whose tests build inputs without naming a device set
``pytestmark = pytest.mark.usefixtures("on_kernel_device")`` and draw from :func:`gen`.
"""
import torch

from ds4t.backend import default_device


def gen(seed: int) -> torch.Generator:
    """A seeded generator on the kernels' device (values differ between CPU and GPU runs; the
    tests compare against references, never against stored numbers)."""
    return torch.Generator(device=default_device()).manual_seed(seed)
