"""Timing tools for the benchmarks and tests, apart from the library: pipelined, host and device time per call
(``timing.py``), and the trivial ops that time a MAX graph call's host cost (``dispatch.py``)."""
