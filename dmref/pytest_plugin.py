"""Alias of :mod:`dmref.oracle.pytest_plugin` (its old path, so ``-p dmref.pytest_plugin`` keeps working); the same module object."""
import sys

from dmref.oracle import pytest_plugin as _module

sys.modules[__name__] = _module
