"""Vectorised torch implementations of every kernel: the CPU path and the oracle for the Triton kernels."""
