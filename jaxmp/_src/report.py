"""Where precision goes, layer by layer: ``precision_report``.

The step is traced once (``jax.make_jaxpr``; nothing is lowered, compiled or
run) and every matrix product and convolution of the program, nested ones
included, is counted under its *layer path*: the name stack it carries
(``jax.named_scope``, Flax and Haiku module paths, Equinox's) with JAX's
transformation wrappers (``jvp(...)``, ``transpose(...)``, ``vmap(...)``)
taken off. A product whose name stack holds ``transpose(`` belongs to the
backward pass. Each product that does not run in the requested precision is
explained from what the program shows around it (``_why``), in the words of
the float8 warning's table (``shortfall.WIDER``) where it has them.
"""

from __future__ import annotations

import textwrap
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from jaxmp._src import casting
from jaxmp._src import census
from jaxmp._src import compat
from jaxmp._src import float8
from jaxmp._src import in_place
from jaxmp._src import jaxprs
from jaxmp._src import lowered_flops
from jaxmp._src import messages
from jaxmp._src import shortfall
from jaxmp._src import source


# Why a product is not in the requested precision, by reason, for the reasons shortfall.WIDER
# (the float8 warning's table) does not know or says in float8's terms; the others
# (a float8 operand, a custom derivative rule; with a float8 matmul_dtype, the autocast
# rules) are said in its words (``_explain``).
_REASONS = {
    "kept": shortfall.Why(
        "it runs in {compute}: your jaxmp.experimental.Float8Rules keep it there (a named scope in "
        "keep_scopes, min_flops or keep_if), or float8 does not pay for it (an attention's "
        "q @ k.T or probs @ v, a convolution: kept by default), or it is outside the function "
        "autocast runs with matmul_dtype",
        "drop it from the rules, or name its kind in Float8Rules(include=...), to run it in "
        "float8"),
    "operand": shortfall.Why(
        "its operands are {dtypes}: only floating-point products run in a lower precision",
        "convert that operand to a floating-point dtype in your code"),
    "rules": shortfall.Why(
        "autocast runs it as written, in the dtypes your program gives it ({dtypes}): "
        "{primitive} is not in the autocast rules' low_precision set",
        "put it back in jaxmp.AutocastRules.low_precision"),
    "user": shortfall.Why(
        "its operands are {dtypes}, made by your code{origin}",
        "run the step under autocast (mp_value_and_grad's default), or cast that value "
        "(e.g. the layer's dtype=) to {compute}"),
    "forced": shortfall.Why(
        "it is inside jaxmp.force_full_precision, which runs it in float32 on purpose",
        "nothing, if it overflows in {compute}; to run it in {compute}, call that code "
        "without jaxmp.force_full_precision"),
    "outside": shortfall.Why(
        "it is outside the functions jaxmp runs under autocast (the loss given to "
        "mp_value_and_grad, a function given to jaxmp.autocast), so it runs as your code "
        "wrote it, on {dtypes} operands{origin}",
        "nothing, if it is meant to stay wide (a rollout's or an evaluation's forward pass "
        "is often cheap); to run it in {compute} too, call the code that makes it through "
        "jaxmp.autocast(fn, compute_dtype)"),
}
# Where a wide operand made by the user's code comes from, when the program shows it.
_ORIGINS = {
    "closure": ": a value captured by a closure (a batch or weight the step does not take "
               "as an argument), which casting the arguments does not reach",
    "argument": ": an argument of the step that reaches the product uncast",
    "computed": ": a {wide} result of an earlier operation {where}, which JAX's type "
                "promotion carries into this product",
    "converted": ": converted to {wide} {where} (a layer with dtype=jnp.{wide}, or a "
                 "cast in your code)",
    None: " (a layer with dtype=jnp.float32, nnx.Embed, a batch captured by a closure, "
          "float32 noise from jax.random inside the loss)",
}


class LayerFlops(NamedTuple):
    """The matrix-product and convolution FLOPs of one layer path in one pass.

    Attributes:
        layer: the layer path (``"Net/Conv_0"``; ``""`` for products with no
            name at all).
        phase: ``"forward"`` or ``"backward"``.
        flops: FLOPs by operand dtype, as :func:`jaxmp.debug.matmul_flops` names them
            (``"bfloat16"``, ``"float32"``, ``"float8_e4m3fn+float8_e5m2"``...).
    """

    layer: str
    phase: str
    flops: dict


class Wider(NamedTuple):
    """Products of one layer path that do not run in the requested precision, and why.

    Attributes:
        layer: the layer path.
        phase: ``"forward"`` or ``"backward"``.
        dtype: their operand dtype key (as in :class:`LayerFlops`).
        flops: their FLOPs.
        reason: why: ``"kept"`` (your :class:`jaxmp.experimental.Float8Rules`), ``"user"``
            (an operand your code made: a layer with its own dtype, a value
            captured by a closure), ``"forced"`` (inside
            :func:`jaxmp.force_full_precision`), ``"outside"`` (a product outside
            the functions autocast runs, in a step where autocast runs others: a
            rollout's forward pass), ``"operand"`` / ``"float8_operand"`` /
            ``"custom_rule"`` (not supported: a non-floating operand, one float8
            operand, a function with its own derivative rule) or ``"rules"``
            (the autocast rules leave the primitive out of ``low_precision``).
        says: the reason in words.
        fix: what to change to run them in the requested precision.
        where: the user's file and line (``"model.py:12 (Net.__call__)"``).
    """

    layer: str
    phase: str
    dtype: str
    flops: int
    reason: str
    says: str
    fix: str
    where: str


class PrecisionReport(NamedTuple):
    """What :func:`precision_report` found. ``print`` it for a table; :meth:`plot` draws it.

    Attributes:
        layers: ``LayerFlops(layer, phase, flops)`` named tuples, one per
            layer path and pass (``"forward"``, ``"backward"``), forward pass
            first, each in program order; ``flops`` maps operand dtype keys
            (those of :func:`jaxmp.debug.matmul_flops`) to FLOPs.
        wider: ``Wider(layer, phase, dtype, flops, reason, says, fix, where)``
            named tuples, one per layer path, pass, dtype and reason whose
            products are not in the requested precision; ``reason`` is
            ``"user"`` (an operand your code made wider), ``"forced"`` (inside
            :func:`jaxmp.force_full_precision`), ``"outside"`` (outside the
            functions autocast runs), ``"kept"`` (your
            :class:`jaxmp.experimental.Float8Rules`), ``"rules"`` (left out of the autocast
            rules' ``low_precision``), ``"operand"``, ``"float8_operand"`` or
            ``"custom_rule"`` (not supported); ``where`` is your file and line.
        requested: the precision asked for (``"bfloat16"``, ``"float8"``, or
            ``"half precision"`` when no dtype was given).
        compiled: with ``precision_report(..., target="h100")``, the
            :class:`jaxmp.debug.GpuProgram` of the step compiled for that GPU (what it
            runs: XLA may widen products the rows above count in float8);
            ``None`` otherwise.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> def f(w, x):
        ...     return jnp.sum(x @ w)
        >>> report = jaxmp.debug.precision_report(f, jnp.ones((8, 8)), jnp.ones((4, 8)))
        >>> report.totals
        {'float32': 512}
        >>> report.wider[0].reason, report.wider[0].phase
        ('user', 'forward')
    """

    layers: tuple
    wider: tuple
    requested: str
    compiled: Any = None

    @property
    def totals(self) -> dict:
        """FLOPs by operand dtype over all layers (the keys of :func:`jaxmp.debug.matmul_flops`)."""
        totals: dict = {}
        for row in self.layers:
            for key, value in row.flops.items():
                totals[key] = totals.get(key, 0) + value
        return totals

    def table(self) -> str:
        """The FLOPs by layer path, pass and dtype, then the products not in ``requested``."""
        keys = sorted(self.totals, key=lambda k: (-self.totals[k], k))
        rows = [("layer", "pass", *keys)]
        for row in self.layers:
            rows.append((row.layer or "(unnamed)", row.phase,
                         *(_count(row.flops[k]) if k in row.flops else "-" for k in keys)))
        rows.append(("total", "", *(_count(self.totals[k]) for k in keys)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
        total = sum(self.totals.values())
        wide = sum(w.flops for w in self.wider)
        head = (f"precision report: {_count(total)} matrix-product FLOPs, "
                f"{messages.percent(1 - wide / total) if total else '0%'} in {self.requested}")
        out = [head, "", *lines]
        if self.wider:
            out += ["", f"Not in {self.requested}:"]
            merged: dict = {}  # forward and backward products said once
            for w in self.wider:
                key = (w.layer, w.dtype, w.reason, w.says, w.fix, w.where)
                merged.setdefault(key, []).append(w)
            for ws in merged.values():
                w = ws[0]
                phases = " and ".join(x.phase for x in ws)
                out.append(f"  {w.layer or '(unnamed)'}, {phases}: "
                           f"{_count(sum(x.flops for x in ws))} FLOPs in {w.dtype} at {w.where}")
                out += textwrap.wrap(w.says + ".", 96, initial_indent="    ",
                                     subsequent_indent="    ")
                out += textwrap.wrap(f"Fix: {w.fix}.", 96, initial_indent="    ",
                                     subsequent_indent="      ")
        if self.compiled is not None:
            out += ["", *_compiled_lines(self.compiled)]
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path: str | None = None):
        """FLOPs by layer path and dtype as stacked horizontal bars (forward and backward apart).

        Needs matplotlib (imported here, not by jaxmp). Saves the figure to
        ``path`` when one is given; returns the ``matplotlib.figure.Figure``.
        """
        try:
            from matplotlib.figure import Figure
        except ImportError as e:
            raise ImportError("PrecisionReport.plot needs matplotlib: pip install matplotlib "
                              "(the report itself does not; print it for a table).") from e
        keys = sorted(self.totals, key=lambda k: (-self.totals[k], k))
        labels = [f"{r.layer or '(unnamed)'} ({r.phase[:3]})" for r in self.layers]
        fig = Figure(figsize=(8, 1.5 + 0.3 * len(labels)), layout="constrained")
        ax = fig.add_subplot()
        left = np.zeros(len(labels))
        positions = np.arange(len(labels))[::-1]
        for key in keys:
            values = np.array([r.flops.get(key, 0) for r in self.layers], dtype=float)
            ax.barh(positions, values, left=left, label=key)
            left += values
        ax.set_yticks(positions, labels)
        ax.set_xlabel("FLOPs (matrix products and convolutions)")
        ax.set_title(f"FLOPs by layer and operand dtype (requested: {self.requested})")
        ax.legend()
        if path is not None:
            fig.savefig(path)
        return fig


def _compiled_lines(program) -> list[str]:
    """What the GPU runs of the step, for :meth:`PrecisionReport.table`."""
    totals = program.matmul_flops()
    total = sum(totals.values())
    half = lowered_flops.low_precision_share(totals) - lowered_flops.float8_share(totals)
    lines = [f"On {program.target.description}, as XLA compiles the step (the rows above are "
             f"the program before XLA): {_count(total)} matrix-product FLOPs, float8 on "
             f"tensor cores {messages.percent(program.float8_native_share)}, half precision "
             f"{messages.percent(half)}"]
    wider: dict = {}
    for p in program.products:
        if p.widened or not p.tensor_cores:
            key = (p.kind, p.how, p.lhs, p.rhs, p.location or p.op_name)
            wider[key] = wider.get(key, 0) + p.flops * p.runs
    if wider:
        lines.append("  Products XLA widened or runs without tensor cores:")
    for (kind, how, lhs, rhs, where), flops in wider.items():
        lines.append(f"    {_count(flops)} FLOPs: {kind} as {how} on {lhs} x {rhs} at {where}")
    return lines


def _count(n: int) -> str:
    """``n`` with three significant digits and a unit (``1.31M``); exact below 10,000."""
    if n < 10_000:
        return str(n)
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)  # pragma: no cover


# --- Layer paths ----------------------------------------------------------------------------


def _unwrap(part: str) -> str:
    """A name-stack entry without JAX's wrappers: ``transpose(jvp(Net))`` gives ``Net``."""
    return compat.without_transforms(part)


def _name_stack(eqn, enclosing: tuple) -> str:
    return "/".join(s for s in (compat.name_stack(e) for e in (*enclosing, eqn)) if s)


def layer_path(name_stack: str) -> str:
    """The user's layer path in a name stack (``jvp(Net)/Dense_0`` gives ``Net/Dense_0``)."""
    return "/".join(p for p in (_unwrap(p) for p in name_stack.split("/")) if p)


# --- What a product is, and why ---------------------------------------------------------------


def _dtype_key(eqn) -> str:
    """The operand dtype key of a product, as :func:`jaxmp.debug.matmul_flops` names it: the
    dtype it runs in (its result dtype, when JAX converts two different operands to it)."""
    return lowered_flops.product_key(*(np.dtype(v.aval.dtype).name
                                       for v in (*eqn.invars[:2], eqn.outvars[0])))


def _in_requested(key: str, compute: np.dtype | None, matmul: np.dtype | None) -> bool:
    if matmul is not None:
        return lowered_flops.is_float8_key(key)
    if compute is not None:
        return key == compute.name
    return key in lowered_flops.HALF_NAMES or lowered_flops.is_float8_key(key)


class _Program:
    """The products of a traced step, with what produced each value (to explain them)."""

    def __init__(self, closed):
        # Dead code is dropped, as lowering drops it (matmul_flops counts the lowered program).
        self.jaxpr = jaxpr = compat.without_dead_code(closed.jaxpr)
        self.producer: dict = jaxprs.nested_producers(jaxpr)  # var -> (eqn, enclosing)
        self.same: dict = jaxprs.call_aliases(jaxpr)  # a var -> the var it stands for (jit...)
        self.cast_by_autocast: set = set()  # the primitives of products autocast casts
        self.origin: dict = {v: "closure" for v in jaxpr.constvars}
        self.origin.update({v: "argument" for v in jaxpr.invars})
        for eqn, _, _ in jaxprs.walk(jaxpr):
            inner = [j for j, _ in jaxprs.sub_jaxprs(eqn)]
            for j in inner:  # the constants of a nested jit: what its function closed over
                self.origin.update({v: "closure" for v in j.constvars})
            if eqn.primitive.name in compat.PRODUCTS and self.autocast_converts(eqn):
                self.cast_by_autocast.add(eqn.primitive.name)

    def autocast_converts(self, eqn) -> list:
        """The conversions autocast made of the operands of ``eqn`` (right before it)."""
        found = [self.producer.get(v) for v in eqn.invars[:2]]
        return [f[0] for f in found if f is not None and f[0].primitive.name ==
                "convert_element_type" and _made_by_autocast(*f)]

    def origin_of(self, eqn) -> tuple[str | None, str]:
        """Where the widest operand of ``eqn`` got its width (:func:`census.wide_origin`):
        ``("closure", "")``, ``("argument", "")``, ``("computed", where)`` (an operation of
        the user's that made it wide: a ``jnp.zeros``), ``("converted", where)`` (a cast), or
        ``(None, "")`` when unseen."""
        found = census.wide_origin(eqn, self.producer, self.same)
        if found is None or found[1] is None:
            return (self.origin.get(found[0]) if found else None), ""
        made, enclosing = found[1]
        kind = "converted" if made.primitive.name == "convert_element_type" else "computed"
        return kind, source.user_location(made, enclosing)


# The package of autocast, whose interpreter converts the operands of the products it runs.
_AUTOCAST = "jaxmp._src.autocast"


def _made_by_autocast(eqn, enclosing: tuple) -> bool:
    """Whether ``eqn`` was added by autocast itself (a conversion of an operand): its innermost
    frame is in autocast's package (``interpreter.py`` converts; any of its modules counts)."""
    module = source.jaxmp_module(eqn, enclosing)
    return module is not None and (module == _AUTOCAST or module.startswith(_AUTOCAST + "."))


def _widens(eqn) -> bool:
    """Whether a ``convert_element_type`` makes its operand wider."""
    return (np.dtype(compat.new_dtype(eqn)).itemsize
            > np.dtype(eqn.invars[0].aval.dtype).itemsize)


def _why(program: _Program, eqn, enclosing: tuple, name_stack: str, key: str,
         compute: np.dtype | None, matmul: np.dtype | None) -> str:
    """The reason (a key of ``_REASONS``) a product is not in the requested precision."""
    dtypes = [v.aval.dtype for v in eqn.invars[:2]]
    if not all(casting.is_float_dtype(d) for d in dtypes):
        return "operand"
    if any(float8.is_float8_dtype(d) for d in dtypes):
        return "float8_operand"
    # Under float8, a convolution's kernel gradient (and a strided one's input gradient) run in
    # the compute dtype: XLA runs only forward convolutions in float8 (float8.conv_float8_products).
    if (matmul is not None and compute is not None and eqn.primitive.name == "conv_general_dilated"
            and key == compute.name and "transpose(" in name_stack):
        return "conv_backward"
    # A custom_vjp's backward rule is traced inside its own transpose: transpose(...(transpose(.
    if (any(e.primitive.name in compat.CUSTOM_RULES for e in enclosing)
            or compat.transpose_depth(name_stack) > 1):
        return "custom_rule"
    if casting.in_full_precision_scope(name_stack):
        return "forced"
    if matmul is not None and (key == compute.name if compute is not None
                               else key in lowered_flops.HALF_NAMES):
        return "kept"
    # Autocast casts the operands of the products it runs in the compute dtype; one it runs as
    # written gets operands converted back to the program's dtypes, or none at all.
    if any(_widens(c) for c in program.autocast_converts(eqn)) or (
            program.cast_by_autocast and eqn.primitive.name not in program.cast_by_autocast):
        return "rules"
    # Inside a function autocast runs, every product of this primitive has its operands
    # cast (or a reason above): one with none, where autocast casts others, is outside it.
    return "outside" if program.cast_by_autocast else "user"


def _explain(why: str, eqn, enclosing: tuple, program: _Program, compute: np.dtype | None,
             matmul: np.dtype | None) -> tuple[str, str]:
    """What to say of a product not in the requested precision, and the fix."""
    dtypes = " x ".join(np.dtype(v.aval.dtype).name for v in eqn.invars[:2])
    custom = [e.primitive.name for e in enclosing if e.primitive.name in compat.CUSTOM_RULES]
    fields = dict(primitive=eqn.primitive.name, dtypes=dtypes,
                  compute=compute.name if compute is not None else "half precision",
                  rule=compat.CUSTOM_RULES[custom[-1]] if custom else "jax.custom_vjp",
                  origin="")
    if why in ("user", "outside"):
        kind, where = program.origin_of(eqn)
        same = where == source.user_location(eqn, enclosing)
        where = "on that line" if same else f"at {where}"
        wide = max((np.dtype(v.aval.dtype) for v in eqn.invars[:2]), key=lambda d: d.itemsize)
        fields["origin"] = _ORIGINS[kind].format(wide=wide.name, where=where)
    if why not in _REASONS or (matmul is not None and why == "rules"):
        row = shortfall.WIDER[why]
    else:
        row = _REASONS[why]
    return row.says.format(**fields), row.fix.format(**fields)


class _Product(NamedTuple):
    """One product of the traced step, as the report sees it."""

    layer: str
    phase: str
    key: str  # the operand dtype key
    flops: int
    eqn: Any
    enclosing: tuple
    stack: str  # the full name stack
    line: tuple  # source.location_key


def _products(program: _Program) -> list[_Product]:
    """The products of the step, forward pass first, each pass in program order."""
    found = []
    for eqn, flops, enclosing in census.census(program.jaxpr):
        stack = _name_stack(eqn, enclosing)
        found.append(_Product(layer_path(stack),
                              "backward" if compat.is_backward(stack) else "forward",
                              _dtype_key(eqn), flops, eqn, enclosing, stack,
                              source.location_key(eqn, enclosing)))
    # JAX traces some rules (a custom_vjp's forward: float8 products) outside the user's
    # scopes: such a product takes the path of the named products of its source line.
    named: dict = {}
    for p in found:
        if p.layer:
            named.setdefault(p.line, p.layer)
    found = [p if p.layer else p._replace(layer=named.get(p.line, "")) for p in found]
    return sorted(found, key=lambda p: p.phase == "backward")  # stable


def _report(closed, compute: np.dtype | None, matmul: np.dtype | None) -> PrecisionReport:
    program = _Program(closed)
    layers: dict = {}  # (layer, phase) -> FLOPs by dtype key
    wider: dict = {}  # (layer, phase, key, reason, where) -> Wider
    forward: dict = {}  # (source line, dtype key) -> (reason, (says, fix)) of a forward product
    for p in _products(program):
        counts = layers.setdefault((p.layer, p.phase), {})
        counts[p.key] = counts.get(p.key, 0) + p.flops
        if _in_requested(p.key, compute, matmul):
            continue
        if p.phase == "backward" and (p.line, p.key) in forward:
            why, says = forward[p.line, p.key]  # the transpose of a wide product: same reason
        else:
            why = _why(program, p.eqn, p.enclosing, p.stack, p.key, compute, matmul)
            says = _explain(why, p.eqn, p.enclosing, program, compute, matmul)
            if p.phase == "forward":
                forward.setdefault((p.line, p.key), (why, says))
        place = (p.layer, p.phase, p.key, why, source.user_location(p.eqn, p.enclosing))
        if place in wider:
            wider[place] = wider[place]._replace(flops=wider[place].flops + p.flops)
        else:
            wider[place] = Wider(*place[:3], p.flops, why, *says, place[-1])
    if matmul is not None:
        requested = "float8"
    else:
        requested = compute.name if compute is not None else "half precision"
    return PrecisionReport(
        tuple(LayerFlops(layer, phase, flops) for (layer, phase), flops in layers.items()),
        tuple(wider.values()), requested)


def precision_report(fn: Callable, *args: Any, compute_dtype: Any = None,
                     matmul_dtype: Any = None, target: Any = None,
                     **kwargs: Any) -> PrecisionReport:
    """Per layer, the matrix-product FLOPs of a step by dtype, and why some are wider.

    ``fn`` (a training step, or a loss) is traced with the given arguments
    (``jax.make_jaxpr``: nothing is lowered, compiled or run), and each matrix
    product and convolution, nested ones included, is counted under its layer
    path: the names around it (``jax.named_scope``, Flax and Haiku module
    paths, Equinox's), forward and backward products apart (a backward product
    is the transpose of a forward one; it keeps the forward product's names).
    FLOPs are ``2 *`` multiply-adds, by operand dtype as
    :func:`jaxmp.debug.matmul_flops` names them, with the same totals: a
    ``scan``'s body (and a counted ``while`` loop's) once per iteration, and
    the in-place updates of Flax NNX modules and an ``nnx.Optimizer`` passed
    as arguments whatever the step returns.

    Each product not in the requested precision is listed with the line of
    your code it comes from and why: kept by your :class:`jaxmp.experimental.Float8Rules`;
    an operand your code made wider (a layer with ``dtype=jnp.float32``, a
    batch captured by a closure, an argument that is not cast); outside the
    functions jaxmp runs under autocast (a rollout's forward pass beside the
    loss of ``mp_value_and_grad``); not
    supported (an integer operand, a function with its own derivative rule,
    run as written); or left out of the autocast rules' ``low_precision``.

    Args:
        fn: any function, e.g. a whole training step, jitted or not.
        *args: its arguments (arrays, ``jax.ShapeDtypeStruct`` or any pytree;
            non-array leaves, such as an Equinox module's functions or
            ``None``, are closed over). ``fn`` may return any pytree.
        compute_dtype: the precision the products should run in
            (``jnp.bfloat16``, ``jnp.float16``); ``None``: either of them.
        matmul_dtype: a float8 dtype when the step runs its products in
            float8 (``autocast(..., matmul_dtype=...)``): products not in
            float8 are then listed.
        target: ``None``, or a GPU target (``"h100"``, ``"b200"``): the step is
            also compiled for it (:func:`jaxmp.debug.gpu_program`, no GPU needed, JAX's
            CUDA plugin needed) and the report says what that GPU runs, which
            may be wider than the rows (XLA widens some float8 products).
        **kwargs: keyword arguments of ``fn`` (``scaler_state=``...).

    Returns:
        A :class:`jaxmp.debug.PrecisionReport`: ``print`` it for a table, or read
        its ``layers``, ``wider`` and ``totals``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxmp
        >>> def loss_fn(w, x):
        ...     with jax.named_scope("encoder"):
        ...         h = jnp.tanh(x @ w)
        ...     return jnp.mean(h ** 2)
        >>> step = jaxmp.mp_value_and_grad(loss_fn, compute_dtype=jnp.bfloat16)
        >>> w, x = jnp.ones((16, 16)), jnp.ones((8, 16))
        >>> report = jaxmp.debug.precision_report(step, w, x, scaler_state=jaxmp.noop_scaler(),
        ...                                 compute_dtype=jnp.bfloat16)
        >>> [(row.layer, row.phase, row.flops) for row in report.layers]
        [('encoder', 'forward', {'bfloat16': 4096}), ('encoder', 'backward', {'bfloat16': 4096})]
        >>> report.wider
        ()
    """
    casting.check_function(fn, "jaxmp.debug.precision_report",
                           "precision_report(fn, *args, compute_dtype=None, **kwargs)")
    compute = None
    if compute_dtype is not None:
        compute = casting.canonical_float_dtype(compute_dtype, allowed=casting.COMPUTE_DTYPES,
                                                what="compute_dtype")
    matmul = None
    if matmul_dtype is not None:
        matmul = float8.check_matmul_dtype(matmul_dtype, compute if compute is not None
                                           else np.dtype("float32"))
    call, dynamic = in_place.array_function(fn, args, kwargs)  # in-place updates count
    closed = jax.make_jaxpr(call)(dynamic)
    report = _report(closed, compute, matmul)
    in_place.refuse_if_uncounted(closed, sum(report.totals.values()),
                                 "jaxmp.debug.precision_report")
    if target is None:
        return report
    from jaxmp._src import gpu_program  # pylint: disable=import-outside-toplevel
    return report._replace(compiled=gpu_program.gpu_program(fn, *args, target=target, **kwargs))
