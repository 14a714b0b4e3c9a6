"""Mojo kernels for MAX, called from PyTorch: the p22 puzzle ops and a LayerNorm library."""
