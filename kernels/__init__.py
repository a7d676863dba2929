"""Triton kernels, one file per algorithm stage (kernel -> launcher -> *_ref). None yet."""
