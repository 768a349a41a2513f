"""Triton kernels of the CUDA backend, one file per kernel family."""
