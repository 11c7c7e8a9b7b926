"""Backend-independent measures of what mixed precision buys.

Time and peak memory depend on the machine. These two measures do not, so they
can be tracked on a CPU-only machine and still say what a GPU will see:

* :func:`saved_activation_bytes`: the bytes a function's VJP keeps for the
  backward pass (the activations), from ``jax.eval_shape``: nothing runs.
* :func:`matmul_flops` / :func:`half_matmul_flop_share` /
  :func:`float8_matmul_flop_share`: the FLOPs of every matrix product and
  convolution in the program lowered for a GPU, by dtype.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxmp._src import casting
from jaxmp._src import host
from jaxmp._src import jaxprs

PyTree = Any

#: The :func:`matmul_flops` keys of half-precision products (both operands float16, or both
#: bfloat16).
HALF_NAMES = ("float16", "bfloat16")
_MLIR_DTYPES = {
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
    "f8E4M3FN": "float8_e4m3fn",
    "f8E5M2": "float8_e5m2",
}


def is_dynamic(x: Any) -> bool:
    """Whether the argument leaf ``x`` is traced (an array or a ``jax.ShapeDtypeStruct``) by the
    measures here and :func:`jaxmp.debug.gpu_program`; any other leaf is closed over."""
    return casting.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _arrays(tree: PyTree) -> list:
    """The array leaves of ``tree``: what a traced function may return.

    A step's outputs may hold what is not a JAX type (an Equinox module
    returned updated holds its activation function, a ``jax.custom_jvp``;
    static fields; strings): the measures here need only the arrays.
    """
    return [x for x in jax.tree_util.tree_leaves(tree) if casting.is_array(x)]


def saved_activation_bytes(
    fn: Callable, *args: Any, argnums: int | Sequence[int] = 0, has_aux: bool = False, **kwargs: Any
) -> int:
    """Bytes that the VJP of ``fn`` keeps for the backward pass.

    Differentiates ``fn`` with respect to the floating-point leaves of
    ``args[argnums]`` under ``jax.eval_shape`` and sums the sizes of everything
    the resulting VJP closure holds (the residuals). Nothing is computed or
    allocated, so it is cheap even for large models, and it does not depend on
    the backend. Arguments may be ``jax.ShapeDtypeStruct``, and any pytree:
    leaves that are not arrays (an Equinox module's functions, ``None``,
    strings) are closed over, and those ``fn`` returns are dropped.

    Args:
        fn: the function, typically a loss ``fn(params, batch) -> scalar``.
        *args: its positional arguments.
        argnums: which positional arguments are differentiated.
        has_aux: whether ``fn`` returns ``(output, aux)``.
        **kwargs: keyword arguments, not differentiated.

    Returns:
        The number of bytes, an ``int``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxmp
        >>> def loss(w, x):
        ...     return jnp.sum(jnp.tanh(x @ w))
        >>> w, x = jnp.ones((64, 64)), jnp.ones((128, 64))
        >>> full = jaxmp.debug.saved_activation_bytes(loss, w, x)
        >>> half = jaxmp.debug.saved_activation_bytes(jaxmp.cast_function(loss, jnp.float16), w, x)
        >>> full / half
        2.0
    """
    casting.check_function(fn, "jaxmp.debug.saved_activation_bytes",
                           "saved_activation_bytes(fn, *args, argnums=0, has_aux=False)")
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def residuals(*call_args, **call_kwargs):
        diff, rebuild = jaxprs.at_positions(call_args, nums)

        def f(*floats):
            out = fn(*rebuild(floats), **call_kwargs)
            if not has_aux:
                return _arrays(out)
            # Not a pair: jax.vjp says what has_aux=True expects.
            return (_arrays(out[0]), out[1]) if isinstance(out, tuple) and len(out) == 2 else out

        out = jax.vjp(f, *diff, has_aux=has_aux)
        return out[1]

    shapes = jax.eval_shape(*jaxprs.over_arrays(residuals, args, kwargs, is_dynamic))
    return int(sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize
                   for s in jax.tree_util.tree_leaves(shapes)))


_TENSOR = r"tensor<((?:\d+x)*)([a-zA-Z][a-zA-Z0-9]*)>"
_SIGNATURE = re.compile(r":\s*\(" + _TENSOR + r",\s*" + _TENSOR + r"\)\s*->\s*" + _TENSOR)
_CONTRACTING = re.compile(r"contracting_dims\s*=\s*\[([0-9, ]*)\]")
_CONV_DIMS = re.compile(r"dim_numbers\s*=\s*\[[^\]]*\]x\[([^\]]*)\]")


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
    """:func:`matmul_flops`'s totals from a lowered module's text (StableHLO).

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
        macs = math.prod(out) * math.prod(rhs) // rhs[labels.index("o")]
    return product_key(_dtype_name(lhs_t), _dtype_name(rhs_t)), 2 * macs


def product_key(lhs: str, rhs: str) -> str:
    """The key a product of operand dtypes ``lhs`` and ``rhs`` (NumPy names) is counted under.

    The dtype when both agree; two float8 formats (e4m3 weights times an e5m2
    cotangent) joined by ``+``, one float8 product; else ``"mixed"``.
    """
    if lhs == rhs:
        return lhs
    if _is_float8_name(lhs) and _is_float8_name(rhs):
        return "+".join(sorted((lhs, rhs)))
    return "mixed"


def _is_float8_name(name: str) -> bool:
    return name.startswith("float8_") or name.startswith("f8")


def is_float8_key(key: str) -> bool:
    """Whether a :func:`matmul_flops` key names a float8 product (one or two float8 formats)."""
    return all(_is_float8_name(part) for part in key.split("+"))


def _unplaced(tree: PyTree) -> PyTree:
    """``tree`` with its concrete arrays as shapes and dtypes, without their devices.

    The FLOPs do not depend on where the values are, and the devices of a
    ``pmap``'s outputs (a mesh of JAX's own) clash with those of the ``pmap``
    itself in a ``jit`` around it ("mesh should be the same across the entire
    program"). A ``jax.ShapeDtypeStruct`` keeps the sharding it was given.
    """
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if casting.is_array(x) else x, tree)


def array_function(fn: Callable, args: tuple, kwargs: dict) -> tuple[Callable, PyTree]:
    """``fn`` as a function of the array leaves of its arguments, to trace or lower.

    Args:
        fn: any function; it may return any pytree.
        args: its positional arguments.
        kwargs: its keyword arguments.

    Returns:
        ``(call, dynamic)``: ``dynamic`` holds the leaves of ``(args, kwargs)``
        that :func:`is_dynamic` accepts, and ``call(dynamic)`` runs ``fn`` with
        the other leaves closed over and returns the array leaves of its result.
    """
    return jaxprs.over_arrays(lambda *a, **k: _arrays(fn(*a, **k)), args, kwargs, is_dynamic)


def matmul_flops(fn: Callable, *args: Any, platform: str = "cuda", target: Any = None,
                 **kwargs: Any) -> dict[str, int]:
    """FLOPs of the matrix products and convolutions of ``jax.jit(fn)``, by dtype.

    Without ``target``, this counts the program jaxmp and JAX build, before XLA
    optimises it: what the step *asks* the compiler for. With ``target="h100"``
    (or ``"b200"``) it counts the optimized program XLA's GPU compiler makes for
    that GPU (:func:`jaxmp.debug.gpu_program`: compiled here, no GPU needed, JAX's CUDA
    plugin needed): what the GPU *runs*. The two differ where XLA widens float8
    operands before a product (the convolutions it cannot run in float8, the
    block-scaled dots of a GPU without them) or runs a product without tensor
    cores; such a product counts under the dtype it runs in (``"float32"`` for
    one in a loop fusion). Compiling takes seconds to minutes.

    ``fn`` is traced with the given arguments and lowered to StableHLO for
    ``platform`` (no such device is needed: lowering for ``"cuda"`` works on a
    CPU-only machine). Each ``dot_general`` and ``convolution`` contributes
    ``2 * multiply-adds`` under the name of its operand dtype, or ``"mixed"``
    when its two operands differ; a product of two different float8 formats
    (the backward products of ``autocast(..., matmul_dtype=...)``) is
    counted under both names joined by ``+``
    (``"float8_e4m3fn+float8_e5m2"``). The block-scaled dots of
    ``float8_scaling="mxfp8"`` (cuDNN custom calls in the CUDA program) count
    under their float8 operands' dtype. A function called several times (a
    nested ``jit``) counts once per call, and the body of a ``lax.scan`` (or
    of a ``fori_loop`` with fixed bounds) once per iteration, as
    :func:`jaxmp.debug.precision_report` counts them: a whole training run in one
    ``jit`` counts every step. The body of a loop whose trip count is not
    fixed when traced (``lax.while_loop``, unless it counts from 0 to a
    constant by 1) counts once.

    Args:
        fn: any function, e.g. a whole training step.
        *args: its arguments (arrays, ``jax.ShapeDtypeStruct`` or any pytree;
            non-array leaves, such as the functions and static fields of an
            Equinox module, or ``None``, are closed over). ``fn`` may return
            any pytree too (a model updated by a training step): only its
            array leaves are kept. Arrays are read for their shapes and
            dtypes (the outputs of a ``pmap`` step can go back into it); a
            ``jax.ShapeDtypeStruct`` keeps its sharding.
        platform: the platform to lower for (without ``target``).
        target: ``None`` (the program before XLA), or a GPU target (``"h100"``,
            ``"b200"``, a :class:`jaxmp.debug.GpuTarget`): the optimized program for it.
        **kwargs: keyword arguments.

    Returns:
        A dict from dtype name (``"float16"``, ``"float32"``, ...) to FLOPs.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> a, b = jnp.ones((2, 3), jnp.float16), jnp.ones((3, 4), jnp.float16)
        >>> jaxmp.debug.matmul_flops(lambda a, b: a @ b, a, b)  # 2 * 2*3*4 multiply-adds
        {'float16': 48}
    """
    casting.check_function(fn, "jaxmp.debug.matmul_flops", "matmul_flops(fn, *args, **kwargs)")
    if target is not None:
        from jaxmp._src import gpu_program  # pylint: disable=import-outside-toplevel
        return gpu_program.gpu_program(fn, *args, target=target, **kwargs).matmul_flops()
    call, dynamic = array_function(fn, args, kwargs)
    with host.no_host_callbacks():  # host callbacks cannot be lowered for another platform
        lowered = jax.jit(call).trace(_unplaced(dynamic)).lower(lowering_platforms=(platform,))
    return module_flops(lowered.as_text())


def half_matmul_flop_share(fn: Callable, *args: Any, platform: str = "cuda", target: Any = None,
                           **kwargs: Any) -> float:
    """The share of :func:`matmul_flops` in low precision: float16, bfloat16 or float8 operands.

    A product counts when both operands are float16, both bfloat16, or both
    float8 (of one or two float8 formats); :func:`float8_matmul_flop_share`
    counts the float8 ones alone. Returns ``0.0`` for a function with no
    matrix products. ``target="h100"`` counts what that GPU runs instead of
    what the step asks for (see :func:`matmul_flops`).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> def f(w, x):
        ...     return jnp.sum(x @ w)
        >>> w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
        >>> jaxmp.debug.half_matmul_flop_share(f, w, x)
        0.0
        >>> jaxmp.debug.half_matmul_flop_share(jaxmp.cast_function(f, jnp.float16), w, x)
        1.0
    """
    return low_precision_share(matmul_flops(fn, *args, platform=platform, target=target, **kwargs))


def float8_matmul_flop_share(fn: Callable, *args: Any, platform: str = "cuda", target: Any = None,
                             **kwargs: Any) -> float:
    """The share of :func:`matmul_flops` whose operands are both float8 (any float8 formats).

    Returns ``0.0`` for a function with no matrix products. Without
    ``target`` this is the share jaxmp *asks* XLA for; with ``target="h100"``
    (or ``"b200"``) the share that GPU runs on float8 tensor cores
    (:func:`jaxmp.debug.gpu_program`), which can be lower: XLA widens the float8
    operands of some products before running them.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> def f(w, x):
        ...     return jnp.sum(x @ w)
        >>> w, x = jnp.ones((32, 32)), jnp.ones((16, 32))
        >>> jaxmp.debug.float8_matmul_flop_share(jaxmp.autocast(f, jnp.bfloat16), w, x)
        0.0
        >>> jaxmp.debug.float8_matmul_flop_share(
        ...     jaxmp.autocast(f, jnp.bfloat16, matmul_dtype=jnp.float8_e4m3fn), w, x)
        1.0
    """
    return float8_share(matmul_flops(fn, *args, platform=platform, target=target, **kwargs))


def low_precision_share(totals: dict[str, int]) -> float:
    """The share of half-precision and float8 products in :func:`matmul_flops` counts."""
    total = sum(totals.values())
    low = sum(v for k, v in totals.items() if k in HALF_NAMES or is_float8_key(k))
    return low / total if total else 0.0


def float8_share(totals: dict[str, int]) -> float:
    """The share of float8 products in :func:`matmul_flops` counts."""
    total = sum(totals.values())
    return sum(v for k, v in totals.items() if is_float8_key(k)) / total if total else 0.0
