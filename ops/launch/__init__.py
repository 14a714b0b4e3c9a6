"""How the ops reach a device: two routes to the same Mojo kernels, and what both build on.

* ``bridge`` (the graph route): the kernels as MAX custom ops, called through a MAX graph on torch tensors. The
  puzzle and every CPU call take it; ``together`` compiles a package's graphs as one module, ``progress`` shows it.
* ``direct`` (the direct route): the kernels compiled to PTX (``ptx``) and launched on torch's current stream, from
  Python or from the C++ entries in ``direct.cpp`` and ``native/`` (eager calls, CUDA graphs, the ops torch.compile's
  graphs call); ``plans`` hands each shape's plan to the C++ tables.
* ``packages`` (Mojo packages), ``cache`` (the build cache: locks, checksums, sweeping), ``mojo_constants`` (the
  kernels' constants, read from their sources).

Which kernel and launch a shape gets is each op's own config module (``ops/<op>/config.py``); both routes take
that choice. Design note: docs/direct_launch.md.
"""
