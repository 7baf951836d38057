"""Alias of :mod:`dmref.cudnn.replay` (its old path); the same module object."""
import sys

from dmref.cudnn import replay as _module

sys.modules[__name__] = _module
