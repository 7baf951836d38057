"""Alias of :mod:`dmref.oracle.probe` (its old path); the same module object."""
import sys

from dmref.oracle import probe as _module

sys.modules[__name__] = _module
