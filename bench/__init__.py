"""kvserve's benchmark: the PagedAttention comparison table on ShareGPT, with peers and plots.

``python -m bench --help``; the measured table is in docs/benchmarks.md.
"""
