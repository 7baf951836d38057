"""Triton FP8 attention kernels for Hopper (sm_90) and their torch.autograd wrappers.

This is the only part of dmref that imports triton, and only lazily: importing
``dmref.kernels`` on a machine without triton or without a GPU works; calling a kernel there
raises a clear error.
"""
