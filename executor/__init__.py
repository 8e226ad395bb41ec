"""executor: model forward passes over a paged KV cache (torch, CUDA and MUSA attention backends)."""
