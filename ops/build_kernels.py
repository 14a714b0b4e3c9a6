"""``poe build-kernels``: every kernel instantiation the ops launch by default, compiled to PTX for a target, and
the C++ launcher; on any machine, GPU or not. It sits above the ops' configs (which list what they launch) and
the direct launcher (which builds it)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ops.launch import direct, ptx
from ops.layernorm import config as layernorm_config
from ops.layernorm_linear import config as layernorm_linear_config
from ops.rmsnorm import config as rmsnorm_config


def main(argv: Sequence[str] | None = None) -> int:
    """Build every default instantiation for ``--target`` (default H100); print what was built and where."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", default="H100", choices=[t for t, _ in ptx.TARGETS.values()])
    a = p.parse_args(argv)
    specs = layernorm_config.all_specs() + layernorm_linear_config.all_specs() + rmsnorm_config.all_specs()
    built = ptx.build(specs, a.target)
    print(f"{len(specs)} kernels for {a.target}: {built} built, {len(specs) - built} cached, "
          f"in {ptx.ptx_dir(a.target)}")
    try:
        print(f"C++ launcher: {direct.build_native()}")
    except direct.NativeBuildError as e:
        print(f"C++ launcher not built (calls take the Python route): {e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
