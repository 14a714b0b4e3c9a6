"""The kernels' integer constants, read from their Mojo sources: one source for the sizes and limits that both the
kernels and their launches use (tile sizes, threads per block, shared memory, kernel codes).

``comptime(module)`` reads every top-level ``comptime NAME = EXPR`` (or ``comptime NAME: Int = EXPR``) of
``ops/kernels/<module>.mojo`` whose EXPR is integer arithmetic over literals and the names defined above it; the rest
(types, functions of parameters) is not a launch constant and is left out. A config module then takes its values
from here instead of writing them again.
"""

from __future__ import annotations

import ast
import operator
import re
from functools import cache
from pathlib import Path

from ops.launch.bridge import LIBRARY

_LINE = re.compile(r"^comptime\s+([A-Za-z_]\w*)\s*(?::\s*\w+\s*)?=\s*(.+?)\s*(?:#.*)?$")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitOr: operator.or_,
        ast.BitAnd: operator.and_}


def _value(node: ast.AST, known: dict[str, int]) -> int:
    """An integer expression's value, or KeyError / TypeError for anything else."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name):
        return known[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left, known), _value(node.right, known))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand, known)
    raise TypeError(ast.dump(node))


@cache
def comptime(module: str) -> dict[str, int]:
    """NAME -> value of ``ops/kernels/<module>.mojo``'s top-level integer ``comptime`` constants, in order."""
    return constants_in(LIBRARY / f"{module}.mojo")


def constants_in(path: Path) -> dict[str, int]:
    """NAME -> value of the top-level integer ``comptime`` constants of the Mojo file at ``path``, read now."""
    known: dict[str, int] = {}
    for line in path.read_text().splitlines():
        if m := _LINE.match(line):
            try:
                known[m.group(1)] = _value(ast.parse(m.group(2), mode="eval").body, known)
            except (SyntaxError, KeyError, TypeError):
                continue   # not integer arithmetic over known names: not a launch constant
    return known
