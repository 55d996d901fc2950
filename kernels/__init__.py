"""Triton kernels with pure-torch references."""
