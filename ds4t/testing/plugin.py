"""pytest plugin for ds4t (entry point ``pytest11`` named ``ds4t.testing.plugin``: pytest loads it
once ds4t is installed; ``-p ds4t.testing.plugin`` loads it from a checkout that is not installed,
``-p no:ds4t.testing.plugin`` turns it off).

Fixtures:

- ``ds4t_device``: the kernels' device, ``torch.device("cuda")`` with a GPU, else ``"cpu"`` (the
  Triton interpreter).
- ``on_kernel_device``: tensors made without a device land on the kernels' device for the test.
- ``ds4t_model``: a freshly loaded model (``tiny-qwen`` unless parametrised). Parametrise it
  indirectly with preset names or ``(name, {load options})`` pairs::

      @pytest.mark.parametrize("ds4t_model", ["tiny-glm", ("tiny-glm", {"native_window": 20})],
                               indirect=True)
      def test_mine(ds4t_model): ...

Hypothesis: registers the profile ``"ds4t"`` (no deadline, slow-data health checks off: kernels
in the interpreter take seconds per example) and loads it, unless ``--hypothesis-profile`` names
another one.
"""
from __future__ import annotations

import pytest
import torch

from ds4t.backend import default_device
from ds4t.testing import HYPOTHESIS_PROFILE, TINY_PRESETS


def register_hypothesis_profile() -> bool:
    """Register the ``"ds4t"`` hypothesis profile; False when hypothesis is not installed."""
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:
        return False
    settings.register_profile(HYPOTHESIS_PROFILE, deadline=None, suppress_health_check=[
        HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    return True


def pytest_configure(config):
    if register_hypothesis_profile() and not config.getoption("hypothesis_profile", None):
        from hypothesis import settings

        settings.load_profile(HYPOTHESIS_PROFILE)


def pytest_report_header(config):
    import os

    import ds4t
    from ds4t.backend import device_name

    return f"ds4t {ds4t.__version__} ({os.path.dirname(ds4t.__file__)}): kernels on {device_name()}"


@pytest.fixture
def ds4t_device() -> torch.device:
    """The device ds4t's kernels run on."""
    return default_device()


@pytest.fixture
def on_kernel_device():
    """Tensors made without a device land on the kernels' device for the test's duration."""
    prev = torch.get_default_device()
    torch.set_default_device(default_device())
    yield default_device()
    torch.set_default_device(prev)


def _model_param(param):
    if isinstance(param, str):
        return param, {}
    if isinstance(param, (tuple, list)) and len(param) == 2 and isinstance(param[0], str) and isinstance(param[1], dict):
        return param[0], dict(param[1])
    raise TypeError(f"ds4t_model: parametrise with a preset name or (name, {{load options}}), got {param!r}")


@pytest.fixture
def ds4t_model(request):
    """A model loaded fresh for the test (models hold mutable options, e.g. ``native_window``)."""
    import ds4t

    name, options = _model_param(getattr(request, "param", TINY_PRESETS[0]))
    return ds4t.load(name, **options)
