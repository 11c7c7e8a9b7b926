"""The FLOPs of the matrix products and convolutions of a lowered program, by operand dtypes.

:func:`module_flops` reads a StableHLO module's text (what ``jax.jit(f).lower``
gives, before XLA optimises it): every ``dot_general``, ``convolution`` and
cuDNN block-scaled dot, times the trip count of the loops around it (a loop
whose trip count the text fixes: a ``lax.scan``, a ``fori_loop`` from a
constant). The keys (:func:`product_key`) name the operand dtypes, and
:func:`low_precision_share` / :func:`float8_share` turn the totals into the
shares the public measures report.

This is the counting that :func:`jaxmp.debug.matmul_flops`,
:func:`jaxmp.debug.precision_report` and :func:`jaxmp.debug.gpu_program` share;
the first two count the same products, one from the lowered text, the other
from the jaxpr (:func:`jaxprs.eqn_flops`), and tests/test_jaxprs.py checks
that they agree on loops.
"""

from __future__ import annotations

import math
import re

from jaxmp._src import jaxprs

#: The :func:`jaxmp.debug.matmul_flops` keys of half-precision products (both operands
#: float16, or both bfloat16).
HALF_NAMES = ("float16", "bfloat16")
_MLIR_DTYPES = {
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
    "f8E4M3FN": "float8_e4m3fn",
    "f8E5M2": "float8_e5m2",
    "f4E2M1FN": "float4_e2m1fn",
}


_TENSOR = r"tensor<((?:\d+x)*)([a-zA-Z][a-zA-Z0-9]*)>"
_SIGNATURE = re.compile(r":\s*\(" + _TENSOR + r",\s*" + _TENSOR + r"\)\s*->\s*" + _TENSOR)
_CONTRACTING = re.compile(r"contracting_dims\s*=\s*\[([0-9, ]*)\]")
_CONV_DIMS = re.compile(r"dim_numbers\s*=\s*\[[^\]]*\]x\[([^\]]*)\]")
_LHS_DILATE = re.compile(r"lhs_dilate\s*=\s*\[([0-9, ]*)\]")


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split("x") if d)


def _dtype_name(mlir_name: str) -> str:
    return _MLIR_DTYPES.get(mlir_name, mlir_name)


_FUNC = re.compile(r"func\.func\s+(?:public\s+|private\s+)?@(\"[^\"]+\"|[^(\s]+)\(")
_CALL = re.compile(r"(?<![\w.])(?:func\.)?call\s+@(\"[^\"]+\"|[^(\s]+)\(")
# cuDNN's block-scaled dot (what jax.nn.scaled_matmul lowers to on CUDA): operands
# (B, M, K) and (B, N, K) in float8, then their block scales; result (B, M, N).
_BLOCK_SCALED_DOT = "@__op$block_scaled_dot("
_OPERANDS = re.compile(r":\s*\((.*)\)\s*->\s*" + _TENSOR)


def _block_scaled_flops(line: str) -> tuple[str, int]:
    found = _OPERANDS.search(line)
    tensors = re.findall(_TENSOR, found.group(1)) if found else []
    if len(tensors) < 2:
        raise ValueError(f"Could not read the operand types of: {line.strip()[:200]}")
    (lhs, lhs_t), (rhs, rhs_t) = tensors[:2]
    (b, m, k), n = _dims(lhs), _dims(rhs)[1]
    return product_key(_dtype_name(lhs_t), _dtype_name(rhs_t)), 2 * b * m * n * k


# A counted while loop (that of a lowered scan or fori_loop with fixed bounds, or a
# while_loop written so): a counter from the constant 0, compared with a constant,
# plus 1 on each iteration.
_WHILE = re.compile(r"=\s*stablehlo\.while\((.*?)\)\s*:")
_LOOP_INIT = re.compile(r"(%[\w#.]+)\s*=\s*(%[\w#.]+)")
_INT_CONSTANT = re.compile(
    r"(%[\w#.]+)\s*=\s*stablehlo\.constant\s+dense<(-?\d+)>\s*:\s*tensor<[ui](?:8|16|32|64)>")
_LESS_THAN = re.compile(r"(%[\w#.]+)\s*=\s*stablehlo\.compare\s+LT,\s*(%[\w#.]+),\s*(%[\w#.]+)")
_ADD = re.compile(r"(%[\w#.]+)\s*=\s*stablehlo\.add\s+(%[\w#.]+),\s*(%[\w#.]+)")
_RETURN = re.compile(r"stablehlo\.return\s+([^:]*)")


class _Loop:
    """A ``stablehlo.while`` being read: where it is, and what says how often it runs."""

    def __init__(self, line: int, indent: int, inits: list, constants: dict):
        self.line, self.indent, self.in_body = line, indent, False
        self.args = [arg for arg, _ in inits]
        self.starts = {arg: constants.get(init) for arg, init in inits}
        self.compared: dict = {}  # the cond's comparisons: result -> (counter, bound)
        self.counter = self.bound = None
        self.plus_one: dict = {}  # the body's values that are an argument plus 1

    def read(self, line: str, stripped: str, constants: dict) -> None:
        """Reads one line of the loop's own regions (not of loops nested in them)."""
        if not self.in_body:
            found = _LESS_THAN.search(line)
            if found and self.starts.get(found.group(2)) == 0:
                self.compared[found.group(1)] = (found.group(2), constants.get(found.group(3)))
            returned = _RETURN.search(stripped)
            if returned and returned.group(1).strip() in self.compared:
                self.counter, self.bound = self.compared[returned.group(1).strip()]
            return
        found = _ADD.search(line)
        if found:
            result, a, b = found.groups()
            for arg, other in ((a, b), (b, a)):
                if arg in self.starts and constants.get(other) == 1:
                    self.plus_one[result] = arg

    def trips(self, stripped: str) -> int | None:
        """The trip count, from the body's ``stablehlo.return``: ``None`` unless counted."""
        returned = _RETURN.search(stripped)
        if returned is None or self.counter is None or self.bound is None:
            return None
        values = [v.strip() for v in returned.group(1).split(",")]
        position = self.args.index(self.counter)
        counted = position < len(values) and self.plus_one.get(values[position]) == self.counter
        return max(self.bound, 0) if counted else None


def _loop_trips(lines: list[str]) -> dict[int, int]:
    """The trip count of each counted ``stablehlo.while``, by its line number."""
    trips: dict[int, int] = {}
    loops: list[_Loop] = []
    constants: dict[str, int] = {}
    for number, line in enumerate(lines):
        if _FUNC.search(line):
            loops, constants = [], {}
            continue
        stripped, indent = line.strip(), len(line) - len(line.lstrip())
        if loops and indent == loops[-1].indent and stripped.startswith("}"):
            if stripped.startswith("} do"):
                loops[-1].in_body = True
            else:
                loops.pop()
            continue
        constant = _INT_CONSTANT.search(line)
        if constant:
            constants[constant.group(1)] = int(constant.group(2))
        if loops and indent == loops[-1].indent + 2:
            loops[-1].read(line, stripped, constants)
            if loops[-1].in_body and stripped.startswith("stablehlo.return"):
                counted = loops[-1].trips(stripped)
                if counted is not None:
                    trips[loops[-1].line] = counted
        found = _WHILE.search(line)
        if found:
            loops.append(_Loop(number, indent, _LOOP_INIT.findall(found.group(1)), constants))
    return trips


def module_flops(text: str) -> dict[str, int]:
    """:func:`jaxmp.debug.matmul_flops`'s totals from a lowered module's text (StableHLO).

    Each function's products count once per call of it (JAX lowers a nested
    ``jit`` called twice as one function), and a loop's once per iteration
    when the loop counts its iterations (:func:`_loop_trips`: the ``while``
    of a ``scan``); the body of any other ``while`` counts once, as
    :func:`jaxprs.loop_trips` counts them in a jaxpr.
    """
    lines = text.splitlines()
    trips = _loop_trips(lines)
    own: dict[str, dict[str, int]] = {}
    callees: dict[str, list[tuple[str, int]]] = {}
    current = "main"
    loops: list[tuple[int, int]] = []  # (indentation, trip count) of the enclosing loops
    for number, line in enumerate(lines):
        declared = _FUNC.search(line)
        if declared:
            current, loops = declared.group(1), []
            continue
        stripped, indent = line.strip(), len(line) - len(line.lstrip())
        if loops and indent == loops[-1][0] and stripped.startswith("}"):
            if not stripped.startswith("} do"):
                loops.pop()
            continue
        times = math.prod(n for _, n in loops)
        callees.setdefault(current, []).extend((c, times) for c in _CALL.findall(line))
        found = (_block_scaled_flops(line) if _BLOCK_SCALED_DOT in line else _op_flops(line))
        if found is not None:
            totals = own.setdefault(current, {})
            totals[found[0]] = totals.get(found[0], 0) + times * found[1]
        if _WHILE.search(line):
            loops.append((indent, trips.get(number, 1)))
    totals: dict[str, int] = {}

    def add(name: str, times: int, depth: int = 0):
        if depth > 64:  # a recursive call graph: no such StableHLO, but never loop
            return
        for key, flops in own.get(name, {}).items():
            totals[key] = totals.get(key, 0) + times * flops
        for callee, repeat in callees.get(name, ()):
            add(callee, times * repeat, depth + 1)

    add("main", 1)
    return totals


def _op_flops(line: str) -> tuple[str, int] | None:
    """FLOPs and operand dtype key of one dot_general/convolution line of StableHLO text."""
    is_dot = "stablehlo.dot_general" in line
    is_conv = "stablehlo.convolution" in line
    if not (is_dot or is_conv):
        return None
    sig = _SIGNATURE.search(line)
    if sig is None:
        raise ValueError(f"Could not read the operand types of: {line.strip()[:200]}")
    lhs, lhs_t, rhs, rhs_t, out, _ = sig.groups()
    lhs, rhs, out = _dims(lhs), _dims(rhs), _dims(out)
    if is_dot:
        found = _CONTRACTING.search(line)
        contracting = [int(i) for i in found.group(1).split(",") if i.strip()] if found else []
        macs = math.prod(out) * math.prod(lhs[i] for i in contracting)
    else:
        # Each output element takes prod(kernel) / out_features multiply-adds.
        labels = [d.strip() for d in _CONV_DIMS.search(line).group(1).split(",")]
        found = _LHS_DILATE.search(line)
        dilation = [int(i) for i in found.group(1).split(",") if i.strip()] if found else []
        macs = jaxprs.conv_macs(out, rhs, rhs[labels.index("o")], dilation)
    return product_key(_dtype_name(lhs_t), _dtype_name(rhs_t)), 2 * macs


def product_key(lhs: str, rhs: str, out: str | None = None) -> str:
    """The key a product of operand dtypes ``lhs`` and ``rhs`` (NumPy names) is counted under.

    The dtype when both agree; two float8 formats (e4m3 weights times an e5m2
    cotangent) joined by ``+``, one float8 product; else ``"mixed"``, or, for
    a product read from a jaxpr, its result dtype ``out``: JAX lowers a
    ``dot_general`` of two different operand dtypes for CPU and GPU with both
    converted to its result dtype (a float32 cotangent times a bfloat16
    activation runs in float32), which is what the lowered text shows.
    """
    if lhs == rhs:
        return lhs
    if _is_float8_name(lhs) and _is_float8_name(rhs):
        return "+".join(sorted((lhs, rhs)))
    return "mixed" if out is None else out


def _is_float8_name(name: str) -> bool:
    """Float8 or float4 (NVFP4's elements): the scaled formats, counted together."""
    return name.startswith(("float8_", "f8", "float4_", "f4"))


def is_float8_key(key: str) -> bool:
    """Whether a :func:`jaxmp.debug.matmul_flops` key names a float8 product (one or two
    float8 formats), or a float4 one (``float4_e2m1fn``, NVFP4), counted with them."""
    return all(_is_float8_name(part) for part in key.split("+"))


def low_precision_share(totals: dict[str, int]) -> float:
    """The share of half-precision and float8 products in :func:`jaxmp.debug.matmul_flops`
    counts."""
    total = sum(totals.values())
    low = sum(v for k, v in totals.items() if k in HALF_NAMES or is_float8_key(k))
    return low / total if total else 0.0


def float8_share(totals: dict[str, int]) -> float:
    """The share of float8 products in :func:`jaxmp.debug.matmul_flops` counts."""
    total = sum(totals.values())
    return sum(v for k, v in totals.items() if is_float8_key(k)) / total if total else 0.0
