"""bench/ scripts as modules for the tests that smoke them (bench/ is not a package: its scripts run
as files on the GPU machine)."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load(relpath: str, name: str):
    """The module at ``ROOT / relpath``, registered as ``sys.modules[name]`` (pickling and dataclasses
    look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
