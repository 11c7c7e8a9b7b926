"""The matrix products of a traced step, and the check that most run in half precision.

Framework code often pins its own precision (a Flax layer with
``dtype=jnp.float32``, an embedding whose output keeps the parameters' dtype, a
batch captured by a closure, float32 noise drawn inside the loss): casting the
inputs then leaves the matrix products in float32, and the loss looks right
because it *is* float32's. :func:`warn_if_mostly_float32` counts the FLOPs of
the matrix products and convolutions of the traced loss by operand dtype and
warns when less than half are in half precision.

The census itself (:func:`census`, over :func:`jaxprs.walk`) and which operands of each
product are being differentiated (:func:`differentiated_products`) are also
what the float8 warning counts with (:mod:`jaxmp._src.shortfall`, which says
which products autocast cannot run in float8, and why).

Each warning is said once per place in the user's code (the first product it
names, :func:`source.location_key`), not once per trace: a loss re-created
inside a jitted step, traced again at new shapes, or traced by the FLOP tools
says it once (:func:`messages.warn_once`).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from jaxmp._src import casting
from jaxmp._src import compat
from jaxmp._src import jaxprs
from jaxmp._src import messages
from jaxmp._src import source

_PRODUCTS = compat.PRODUCTS


class MostlyFloat32Warning(UserWarning):
    """Says that a step traced with a half-precision ``compute_dtype`` computes mostly in float32.

    Issued while the step is traced (never by the compiled step), by the
    cast-inputs path (``autocast=False``) when less than half of the loss's
    matrix-product FLOPs have half-precision operands. The message names the
    first float32 product by the user's file and line, and is said once per
    such product: tracing the step again (new shapes, ``jit`` retracing, the
    FLOP tools, a loss re-created inside the step) does not repeat it. A new
    ``warnings.catch_warnings(record=True)`` block starts afresh.

    Examples:
        >>> import warnings
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> w_out = jnp.ones((8, 64))  # captured by the loss: casting the inputs misses it
        >>> def loss_fn(w, x):  # and the layer fixes its own dtype to float32
        ...     h = (x @ w).astype(jnp.float32)
        ...     return jnp.mean(h @ w_out)
        >>> grad_fn = jaxmp.mp_value_and_grad(loss_fn, compute_dtype=jnp.float16, autocast=False)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = grad_fn(jnp.ones((8, 8)), jnp.ones((2, 8)), scaler_state=jaxmp.init_scaler())
        >>> caught[0].category is jaxmp.debug.MostlyFloat32Warning
        True
    """


# --- Which operands are differentiated --------------------------------------------------------

# JAX's tracers of a value being differentiated (reverse mode traces with the linearize
# tracer, forward mode and older JAX with the JVP tracer). Private names: a release that
# renamed them makes every value look undifferentiated (the float8 warnings then count
# forward products only).
_DIFFERENTIATING = frozenset({"LinearizeTracer", "JVPTracer"})


def is_differentiated(x: Any) -> bool:
    """Whether the value ``x`` (an argument of a function being traced) is being differentiated:
    a tracer of JAX's autodiff, possibly inside ``vmap``'s or another's."""
    seen = 0
    while compat.is_tracer(x) and seen < 64:
        if type(x).__name__ in _DIFFERENTIATING:
            return True
        x = next((getattr(x, a) for a in ("primal", "val") if getattr(x, a, None) is not None),
                 None)
        seen += 1
    return False


def _inner_jaxprs(eqn) -> list[tuple[Any, list | None]]:
    """The jaxprs inside ``eqn``, each with the outer values its inputs stand for, in order,
    or with ``None`` when its inputs cannot be matched to the equation's one for one."""
    name = eqn.primitive.name
    outer = list(eqn.invars)
    if name == "cond":
        return [(b.jaxpr, outer[1:]) for b in compat.cond_branches(eqn)]
    if name == "while":
        loop = compat.while_loop(eqn)
        cn, bn = loop.cond_nconsts, loop.body_nconsts
        carry = outer[cn + bn:]
        return [(loop.cond.jaxpr, outer[:cn] + carry),
                (loop.body.jaxpr, outer[cn:cn + bn] + carry)]
    found = []
    for inner, _ in jaxprs.sub_jaxprs(eqn):
        found.append((inner, outer if len(inner.invars) == len(outer) else None))
    return found


def differentiated_products(jaxpr, differentiated: list) -> dict:
    """``{id(product eqn): (lhs differentiated, rhs differentiated)}`` for every product of
    ``jaxpr``, nested ones included, given which of its inputs are differentiated.

    A value is differentiated when it depends on a differentiated input. A product's
    backward products are those of its differentiated operands: the gradient of an operand
    that is not differentiated (a batch, a constant) is never computed. Loop carries are
    followed until they settle; a nested jaxpr whose inputs cannot be matched to the outer
    values counts all of them differentiated when any outer one is.
    """
    marked: set = set()
    out: dict = {}

    def visit(jaxpr, inputs):
        marked.update(v for v, d in zip(jaxpr.invars, inputs) if d)
        for eqn in jaxpr.eqns:
            ins = [not compat.is_literal(v) and v in marked for v in eqn.invars]
            if eqn.primitive.name in _PRODUCTS:
                before = out.get(id(eqn), (False, False))
                out[id(eqn)] = (before[0] or ins[0], before[1] or ins[1])
            loops = eqn.primitive.name in compat.LOOPS
            for _ in range(1 + loops):  # a loop's second pass sees what its carries became
                for inner, outer in _inner_jaxprs(eqn):
                    if outer is None:
                        visit(inner, [any(ins)] * len(inner.invars))
                    else:
                        visit(inner, [not compat.is_literal(v) and v in marked
                                      or w in marked for v, w in zip(outer, inner.invars)])
                if loops:
                    inner = [j for j, _ in _inner_jaxprs(eqn)][-1]
                    carried = [o in marked for o in inner.outvars]
                    if eqn.primitive.name == "scan":
                        scan = compat.scan(eqn)
                        n_carry, first = scan.num_carry, scan.num_consts
                    else:
                        n_carry, first = len(carried), compat.while_loop(eqn).body_nconsts
                    for i in range(n_carry):
                        if carried[i]:
                            marked.add(inner.invars[first + i])
            if any(ins) or any(o in marked for j, _ in _inner_jaxprs(eqn) for o in j.outvars):
                marked.update(eqn.outvars)

    visit(jaxpr, differentiated)
    return out


def census(jaxpr) -> Iterator[tuple[Any, int, tuple]]:
    """``(eqn, flops, enclosing equations)`` for every product of ``jaxpr``, nested ones included."""
    for eqn, repeat, enclosing in jaxprs.walk(jaxpr):
        if eqn.primitive.name in _PRODUCTS:
            yield eqn, repeat * jaxprs.eqn_flops(eqn), enclosing


def wide_origin(eqn, producer: dict, same: dict) -> tuple[Any, Any] | None:
    """Where the widest operand of the product ``eqn`` got its width, in the user's program.

    The operand is followed back (:func:`jaxprs.wide_origins`) past jaxmp's
    own operations (its casts) and the backward pass (a cotangent is as wide
    as the value it differentiates) to the value that was made wide: the first
    such value that is not a widening conversion is taken (JAX's type
    promotion converts the narrow operand of an operation whose other operand
    is float32: the width comes from that one, such as the ``jnp.zeros`` a
    model makes), else the first.

    Args:
        eqn: a ``dot_general`` or ``conv_general_dilated`` equation.
        producer: ``{variable: (eqn, enclosing)}`` of the program
            (:func:`jaxprs.nested_producers`).
        same: the program's :func:`jaxprs.call_aliases`.

    Returns:
        ``(variable, (eqn, enclosing))`` of the equation that made it wide,
        ``(variable, None)`` for an input of the program, or ``None``.
    """
    def no_origin(made, around: tuple) -> bool:  # not where the user's code made a value
        stack = "/".join(s for s in (compat.name_stack(e) for e in (*around, made)) if s)
        return compat.is_backward(stack) or source.made_by_jaxmp(made, around)

    widths = [np.dtype(v.aval.dtype).itemsize for v in eqn.invars[:2]]
    wide = [v for v, w in zip(eqn.invars[:2], widths) if w == max(widths)]
    first = None
    for found in jaxprs.wide_origins(wide, producer, same, skip=no_origin):
        if found[1] is None or found[1][0].primitive.name != "convert_element_type":
            return found
        first = first or found
    return first


def _made_at(jaxpr, eqn, enclosing: tuple) -> str:
    """For the warning: where the user's code made the float32 operand of ``eqn``, when that
    is another line than the product's ("" otherwise)."""
    found = wide_origin(eqn, jaxprs.nested_producers(jaxpr), jaxprs.call_aliases(jaxpr))
    if found is None or found[1] is None:
        return ""
    made = source.user_location(*found[1])
    if made in ("unknown", source.user_location(eqn, enclosing)):
        return ""
    return f"; its {found[0].aval.dtype} operand was made at {made}"


def warn_if_mostly_float32(closed_jaxpr, compute_dtype: Any, api: str) -> bool:
    """Warns when under half of the product FLOPs of ``closed_jaxpr`` have half-precision operands.

    Returns whether it warned. Names the first product with a float32 operand
    by the user's file and line, with its operand dtypes, the line that made
    that operand float32 (:func:`wide_origin`: a ``jnp.zeros`` in the model,
    when the product is the layer it feeds), and the fix. Said once per such
    product (:func:`messages.warn_once`).
    """
    if not casting.is_narrow_dtype(compute_dtype):
        return False
    total = half = 0
    first = None
    for eqn, flops, enclosing in census(closed_jaxpr.jaxpr):
        dtypes = [np.dtype(v.aval.dtype) for v in eqn.invars[:2]]
        total += flops
        if all(casting.is_narrow_dtype(d) for d in dtypes):
            half += flops
        elif first is None:
            first = (eqn, enclosing, dtypes)
    if total == 0 or half * 2 >= total:
        return False
    eqn, enclosing, dtypes = first
    where = source.user_location(eqn, enclosing)
    return messages.warn_once(
        source.location_key(eqn, enclosing),
        f"jaxmp: this {api} step was traced with compute_dtype={np.dtype(compute_dtype).name} "
        f"but runs only {half / total:.0%} of its matrix-product FLOPs in half precision: "
        f"the model computes in float32 and trains at float32's speed and memory. The first "
        f"float32 product is a {eqn.primitive.name} of {dtypes[0].name} x {dtypes[1].name} "
        f"operands at {where}{_made_at(closed_jaxpr.jaxpr, eqn, enclosing)}. Casting the inputs "
        "does not reach values the loss makes itself or layers that fix their own dtype (a Flax "
        "module with dtype=jnp.float32, nnx.Embed, a batch captured by a closure, float32 noise "
        "from jax.random inside the loss).\n"
        "  Fix: autocast=True (the default), which chooses the precision of each operation "
        "inside the loss; or cast those values yourself (e.g. the layer's dtype= to the "
        "compute dtype).",
        MostlyFloat32Warning,
    )
