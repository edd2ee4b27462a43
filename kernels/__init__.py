"""Kernels: Triton on CUDA tensors, the torch reference elsewhere, behind one set of calls."""
