"""How the ops reach a device: two routes to the same Mojo kernels.

* ``bridge`` (the graph route): the kernels as MAX custom ops, called through a MAX graph on torch tensors. The
  puzzle and every CPU call take it.
* ``direct`` (the direct route): the kernels compiled to PTX and launched on torch's current stream, from Python
  or from the C++ entries in ``direct.cpp`` (eager calls, CUDA graphs, the ops torch.compile's graphs call).

Which kernel and launch a shape gets is each op's own config module (``ops/<op>_config.py``); both routes take
that choice. Design note: docs/direct_launch.md.
"""
