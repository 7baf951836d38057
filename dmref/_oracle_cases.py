"""Alias of :mod:`dmref.oracle.cases` (its old path); the same module object."""
import sys

from dmref.oracle import cases as _module

sys.modules[__name__] = _module
