"""Tensor-parallel process groups, the custom all-reduce, the shared-memory broadcast."""
