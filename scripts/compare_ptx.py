"""Which GPU kernels changed since an earlier revision, by their PTX (no GPU needed).

    python scripts/compare_ptx.py 0306017            (prints the comparison)
    python scripts/compare_ptx.py 0306017 --write    (and writes results/ptx_vs_0306017.md)

Builds every kernel the direct route can launch (``poe build-kernels``'s list) at that revision, in a temporary
git worktree, and at the working tree, then compares the two sets of PTX files with kernel and function names
taken out (names changed in the issue-35 renames; code did not). A kernel whose PTX is unchanged runs the same
machine code with the same launch, so a kernel time of it that moved between two benchmark reports moved with
the machine, not with the code: the companion of ``scripts/compare_results.py``. The C++ launcher of both is
compared too, by its instructions (``objdump``).
"""

from __future__ import annotations

import argparse
import collections
import difflib
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import compare_results  # noqa: E402

# Builders by revision: ops/build_kernels.py now, ops/launch/direct.py since the issue-35 layout, ops/direct.py before.
BUILDERS = ("ops.build_kernels", "ops.launch.direct", "ops.direct")
NAME = re.compile(r"\bkernels_\w+")   # every mangled name of ours (kernels and the functions they call)


def build_revision(tree: Path, cache: Path) -> list[Path]:
    """Build every kernel of the revision checked out at ``tree`` into ``cache``; its PTX files."""
    env = {**os.environ, "OPS_CACHE_DIR": str(cache), "PYTHONPATH": str(tree)}
    for module in BUILDERS:
        if (tree / (module.replace(".", "/") + ".py")).exists():
            subprocess.run([sys.executable, "-m", module], cwd=tree, env=env, check=True,
                           stdout=subprocess.DEVNULL)
            return sorted(cache.glob("ptx/*/*.ptx"))
    raise SystemExit(f"compare_ptx: no kernel builder ({', '.join(BUILDERS)}) in {tree}")


def build_at(rev: str, tmp: Path) -> list[Path]:
    """Every kernel of revision ``rev`` built (in a git worktree under ``tmp``) into ``tmp``/old; its PTX files."""
    tree = tmp / "tree"
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), rev], cwd=ROOT, check=True)
    try:
        return build_revision(tree, tmp / "old")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=True)


def machine_code(lib: Path) -> list[str]:
    """The C++ launcher's instructions (``objdump -d``) with addresses, constants and alignment padding taken out:
    equal for equal code, whatever the file layout of its source moved."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True, text=True,
                         check=True).stdout
    lines = []
    for line in out.splitlines():
        if ":\t" not in line:
            continue
        ins = re.sub(r"0x[0-9a-f]+|[0-9a-f]{4,} <[^>]*>|#.*$", "X", line.split(":\t", 1)[1]).strip()
        if ins and not re.fullmatch(r"(cs\s+)?(data16\s+)*nop[wl]?(\s+X\(%[a-z]+,%[a-z]+,1\))?", ins):
            lines.append(ins)
    return lines


def native_difference(old_cache: Path, new_cache: Path) -> str:
    """A line for the report: the two C++ launchers' instructions, equal or how many differ."""
    libs = [sorted(c.glob("native/*/mojo_direct.so")) for c in (old_cache, new_cache)]
    if not all(libs):
        return "C++ launcher: not built on one side (no C++ compiler?), not compared."
    old, new = (machine_code(found[-1]) for found in libs)
    if old == new:
        return f"C++ launcher: the same {len(new)} instructions (addresses, constants and alignment padding aside)."
    changed = sum(1 for line in difflib.unified_diff(old, new, n=0, lineterm="") if line[:1] in "+-") - 2
    return f"C++ launcher: {changed} of {len(new)} instructions differ (addresses, constants and padding aside)."


def build_here() -> dict[Path, str]:
    """Build every kernel of the working tree (``poe build-kernels``'s list, in OPS_CACHE_DIR); kernel function
    name -> its instantiations' PTX files."""
    from ops.launch import direct
    from ops.launch import ptx as ptxlib
    from ops.layernorm import config as layernorm_config
    from ops.layernorm_linear import config as layernorm_linear_config

    specs = list(dict.fromkeys(layernorm_config.all_specs() + layernorm_linear_config.all_specs()))
    ptxlib.build(specs, "H100", quiet=True)
    try:
        direct.build_native(quiet=True)
    except direct.NativeBuildError:
        pass   # native_difference says so
    return {ptxlib.ptx_path(spec, "H100"): spec.name for spec in specs}


def fingerprint(ptx: str) -> str:
    """The PTX without comments and with our mangled names replaced: equal for equal code."""
    body = "\n".join(line for line in ptx.splitlines() if not line.lstrip().startswith("//"))
    return hashlib.sha256(NAME.sub("K", body).encode()).hexdigest()


def compare(built: set[str], new: dict[Path, str]) -> list[tuple[str, int, int]]:
    """Per kernel function of the working tree: its instantiations whose PTX the old revision also built
    (``built``: their fingerprints), and the others (changed or new)."""
    same: collections.Counter = collections.Counter()
    changed: collections.Counter = collections.Counter()
    for path, name in new.items():
        (same if fingerprint(path.read_text()) in built else changed)[name] += 1
    return [(f, same[f], changed[f]) for f in sorted(set(same) | set(changed))]


def moved_rows(rev: str, built: set[str], band: float = 0.05) -> list[str]:
    """Markdown rows: each LayerNorm forward row of ours in results/layernorm.csv whose kernel time is more
    than ``band`` off ``rev``'s (``compare_results``), with whether its kernel's PTX is one ``rev`` built."""
    import torch

    from ops.launch import ptx as ptxlib
    from ops.layernorm import config as layernorm_config

    out = []
    for ratio, key, old, new in sorted(compare_results.ratios("bench_layernorm", rev)[2]):
        kind, impl, dtype, m, h = key
        if kind != "fwd" or not impl.startswith("ours") or abs(ratio - 1.0) <= band:
            continue
        variant = impl.partition(":")[2] or "fast"
        dt = getattr(torch, dtype)
        launch = layernorm_config.fwd_launch(int(m), int(h), dt, True, variant)
        ptx = ptxlib.ptx_path(launch.spec(dt, 0), "H100")
        same = "unchanged" if fingerprint(ptx.read_text()) in built else "changed"
        out.append(f"| {' '.join(key)} | {old} | {new} | {ratio:.3f} | {launch.kernel}{list(launch.params)} | {same} |")
    return out


def report(rev: str, rows: list[tuple[str, int, int]], old_total: int, new_total: int, moved: list[str],
           native: str) -> str:
    lines = [f"# Kernel PTX against {rev}'s", "",
             f"`python scripts/compare_ptx.py {rev}`: the working tree's {new_total} kernel instantiations against "
             f"{rev}'s {old_total}, by PTX with names taken out. \"unchanged\": the same PTX was built at {rev}.", "",
             "| kernel function | unchanged | changed or new |", "|---|---|---|"]
    lines += [f"| {f} | {s} | {c} |" for f, s, c in rows]
    lines += ["", native]
    lines += ["", f"LayerNorm forward rows of ours more than 5% off {rev}'s kernel time "
              f"(results/kernel_times_vs_{rev}.md), and their kernel's PTX:", "",
              "| row | old us | new us | new / old | kernel | PTX |", "|---|---|---|---|---|---|", *moved]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev")
    parser.add_argument("--write", action="store_true", help="write results/ptx_vs_<rev>.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        old = build_at(args.rev, Path(tmp))
        built = {fingerprint(f.read_text()) for f in old}
        os.environ["OPS_CACHE_DIR"] = str(Path(tmp) / "new")
        new = build_here()
        native = native_difference(Path(tmp) / "old", Path(tmp) / "new")
        text = report(args.rev, compare(built, new), len(old), len(new), moved_rows(args.rev, built), native)
    print(text, end="")
    if args.write:
        (ROOT / "results" / f"ptx_vs_{args.rev}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
