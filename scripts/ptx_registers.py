"""Registers per thread of the LayerNorm forward's register kernels, by ptxas (no GPU needed).

    python scripts/ptx_registers.py            (the shapes docs/kernels/layernorm.md cites)
    python scripts/ptx_registers.py 4096x8192  (M x H shapes of your own)

Builds the PTX the direct route launches for each shape (bf16 and fp32, ``layernorm_config.fwd_launch``) and
prints ``ptxas -arch=sm_90a -v``'s register and spill counts: the occupancy facts behind docs/kernels/layernorm.md.
"""

from __future__ import annotations

import re
import subprocess
import sys

import torch

from ops.launch import ptx
from ops.layernorm import config as layernorm_config

SHAPES = ((4096, 8192), (4096, 4096), (16384, 4096), (4096, 768), (65536, 1024))


def main(argv: list[str]) -> int:
    shapes = [tuple(int(d) for d in a.split("x")) for a in argv] or SHAPES
    specs = {(m, h, dt): layernorm_config.fwd_launch(m, h, dt, True).spec(dt, 0)
             for m, h in shapes for dt in (torch.bfloat16, torch.float32)}
    ptx.build(list(dict.fromkeys(specs.values())), "H100", quiet=True)
    for (m, h, dt), spec in specs.items():
        out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(ptx.ptx_path(spec, "H100")), "-o", "/dev/null"],
                             capture_output=True, text=True, check=True).stderr
        regs = re.search(r"Used (\d+) registers", out)
        spill = re.search(r"(\d+) bytes spill stores", out)
        print(f"{m}x{h} {str(dt).removeprefix('torch.'):8s} {spec.expr:48s} registers {regs and regs.group(1)} "
              f"spill stores {spill and spill.group(1)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
