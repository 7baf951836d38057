"""dmref: the reference, emulation and verification library for FP8 attention with
Delta-Matching."""

__version__ = "0.1.0"
