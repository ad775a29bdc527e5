"""Compute kernels: the CPU paged-attention kernel (C++, built on first use) and Triton's."""
