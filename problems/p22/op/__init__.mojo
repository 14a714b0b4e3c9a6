# Puzzle p22 kernels: LayerNorm, transpose, tiled matmul, bias-add, and the
# fused LayerNorm+Linear. Each file registers one or two MAX custom ops.
