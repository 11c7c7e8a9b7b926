"""Finding the operation that overflows: ``find_nonfinite``.

A float16 step that is skipped again and again says only that *some*
gradient was inf or NaN. :func:`find_nonfinite` says which operation made it,
in which pass, at which line: it evaluates the scaled loss and its gradient,
exactly as :func:`jaxmp.mp_value_and_grad` builds them, one equation at a
time on the shared interpreter (``interpret.py``), and beside every value
keeps a float32 *shadow*: the same equation evaluated with every
half-precision operand held in float32. An equation whose inputs are finite
and whose result is not, while its shadow is finite, is where half precision
overflowed.

The forward pass is the jaxpr of the scaled loss; the backward pass is the
jaxpr of its ``value_and_grad`` less the operations the forward pass already
has. The backward pass therefore includes the derivative rules' own
arithmetic, such as ``rsqrt(v) / v`` for the derivative of ``rsqrt``, which
runs before any cotangent exists and does not depend on the loss scale.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import source_info_util
from jax.extend import core as jex_core

from jaxmp._src import casting
from jaxmp._src import kernel
from jaxmp._src import interpret
from jaxmp._src import loss_scale

PyTree = Any

_DTYPE_PARAMS = ("new_dtype", "preferred_element_type", "dtype")
# Derivatives of these blow up for small inputs (1/x, x**-1.5, ...).
_SINGULAR = frozenset({"rsqrt", "sqrt", "div", "log", "pow", "integer_pow", "cbrt", "atanh",
                       "acos", "asin"})
_SUMS = frozenset({"reduce_sum", "cumsum", "reduce_window_sum", "dot_general",
                   "conv_general_dilated", "add_any"})
_EXPS = frozenset({"exp", "exp2", "expm1", "pow", "integer_pow", "square", "sinh", "cosh"})
_INSTALLED_DIRS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
# jaxmp's own package folder, wherever it is installed or checked out (a user's
# project folder that happens to be called "jaxmp" is not library code).
_JAXMP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_MAX_PER_PASS = 12
_MAX_UNDERFLOWS = 4
# Float32 values this large are sentinels (a mask's -1e30), meant to become -inf.
_SENTINEL = 1e30
# An underflow is reported when at least this fraction of a result flushes to zero.
_UNDERFLOW_FRACTION = 0.01
_SCATTERS = {
    "scatter-add": jax.lax.scatter_add,
    "scatter_add": jax.lax.scatter_add,
    "scatter-mul": jax.lax.scatter_mul,
    "scatter_mul": jax.lax.scatter_mul,
    "scatter-min": jax.lax.scatter_min,
    "scatter_min": jax.lax.scatter_min,
    "scatter-max": jax.lax.scatter_max,
    "scatter_max": jax.lax.scatter_max,
}


class Finding(NamedTuple):
    """One operation whose half-precision result went wrong where float32 did not.

    Attributes:
        phase: ``"forward"`` or ``"backward"``.
        kind: ``"overflow"`` (inf or NaN in half precision, finite in float32),
            ``"underflow"`` (zero in half precision, not in float32) or
            ``"float32 too"`` (non-finite in float32 as well: not a precision
            problem, listed for context).
        primitive: the JAX primitive, e.g. ``"exp"`` or ``"div"``.
        where: ``file:line (function)`` of the operation in the Python code
            (the innermost frame outside JAX).
        called_from: when ``where`` is inside a library (Haiku, Flax, ...),
            the first frame of the calling code outside libraries, else ``""``.
        dtype: the dtype of the result, e.g. ``"float16"``.
        count: how many elements went wrong, of ``size``.
        size: the number of elements of the result.
        half_max: the largest magnitude in the half-precision result.
        float32_max: the largest magnitude in the float32 shadow.
        float32_min: the smallest non-zero magnitude in the float32 shadow.
        scale_dependent: for the backward pass, whether the value is
            proportional to the loss scale (an operation on cotangents) or
            not (a derivative rule's own arithmetic).
        hint: what to do about it.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> loss_fn = lambda w: jnp.log(jnp.sum(jnp.exp(w)))
        >>> finding = jaxmp.find_nonfinite(loss_fn)(jnp.full((2,), 12.0)).findings[0]
        >>> finding.phase, finding.kind, finding.primitive, finding.float32_max > 65504
        ('forward', 'overflow', 'exp', True)
    """

    phase: str
    kind: str
    primitive: str
    where: str
    called_from: str
    dtype: str
    count: int
    size: int
    half_max: float
    float32_max: float
    float32_min: float
    scale_dependent: bool
    hint: str


class NonfiniteReport(NamedTuple):
    """What :func:`find_nonfinite` found. ``print`` it for a table.

    ``bool(report)`` is true when some operation produced inf or NaN in half
    precision while float32 did not (an ``"overflow"`` finding); underflows
    are listed but do not make the report true.

    Attributes:
        findings: the :class:`Finding` entries, forward pass first, each pass
            in program order (at most a dozen per pass and kind).
        compute_dtype: the half-precision dtype that was checked.
        loss_scale: the loss scale used.
        loss: the loss in the mixed-precision run (float32, unscaled).
        loss_float32: the loss of the float32 shadow.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> report = jaxmp.find_nonfinite(lambda w: jnp.mean(w * w))(jnp.ones(3))
        >>> bool(report), len(report.findings), report.compute_dtype, report.loss
        (False, 0, 'float16', 1.0)
    """

    findings: tuple[Finding, ...]
    compute_dtype: str
    loss_scale: float
    loss: float
    loss_float32: float

    def __bool__(self) -> bool:
        return any(f.kind == "overflow" for f in self.findings)

    def __len__(self) -> int:
        return len(self.findings)

    @property
    def forward(self) -> tuple[Finding, ...]:
        """The findings of the forward pass."""
        return tuple(f for f in self.findings if f.phase == "forward")

    @property
    def backward(self) -> tuple[Finding, ...]:
        """The findings of the backward pass."""
        return tuple(f for f in self.findings if f.phase == "backward")

    def __str__(self) -> str:
        head = (f"find_nonfinite: {self.compute_dtype}, loss scale {self.loss_scale:g}; "
                f"loss {self.loss:.6g} ({self.compute_dtype}) vs {self.loss_float32:.6g} "
                "(float32 shadow)")
        if not self.findings:
            return head + "\nNo operation overflows or underflows where float32 does not."
        n = sum(f.kind == "overflow" for f in self.findings)
        summary = (f"{n} operation(s) overflow in {self.compute_dtype} where float32 does not"
                   if n else f"No operation overflows in {self.compute_dtype} where float32 "
                   "does not, but some need attention")
        lines = [head, summary + " (first ones per pass, in program order):", ""]
        rows = [("pass", "op", "kind", "elements", "half max|x|", "f32 max|x|", "f32 min|x|",
                 "where")]
        for f in self.findings:
            where = f.where + (f"  <- {f.called_from}" if f.called_from else "")
            rows.append((f.phase, f.primitive, f.kind, f"{f.count}/{f.size}",
                         f"{f.half_max:.3g}", f"{f.float32_max:.3g}", f"{f.float32_min:.3g}",
                         where))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
        lines.append("")
        seen = set()
        for f in self.findings:
            if f.hint not in seen:
                seen.add(f.hint)
                lines.append(f"hint ({f.phase} {f.primitive}, {f.where}): {f.hint}")
        return "\n".join(lines)


def _widen(x: Any) -> Any:
    if x is None or not casting.is_float_dtype(getattr(x, "dtype", None)):
        return x
    wide = casting.wide_dtype(x.dtype)
    return x if x.dtype == wide else jax.lax.convert_element_type(x, wide)



def _frames(eqn) -> list:
    try:
        return list(source_info_util.user_frames(eqn.source_info.traceback))
    except Exception:  # pylint: disable=broad-except  (private JAX API: degrade, never fail)
        return []


def _summary(frame) -> str:
    return f"{os.path.basename(frame.file_name)}:{frame.start_line} ({frame.function_name})"


def _in_library(file_name: str) -> bool:
    """Whether a frame is in installed packages or in jaxmp itself, not in the user's code."""
    path = os.path.abspath(file_name)
    return path.startswith(_JAXMP_DIR) or any(d in path for d in _INSTALLED_DIRS)


def _locate(eqn, enclosing: Sequence[Any] = ()) -> tuple[str, str]:
    """``(where, called_from)`` for ``eqn``; inside a cached nested ``jit`` (``jnp.var``...)
    JAX may keep no user frame, and the innermost enclosing equation's location is used."""
    frames = _frames(eqn)
    for outer in reversed(enclosing):
        if frames:
            break
        frames = _frames(outer)
    if not frames:
        return "unknown", ""
    where = frames[0]
    if not _in_library(where.file_name):
        return _summary(where), ""
    for frame in frames[1:]:
        if not _in_library(frame.file_name):
            return _summary(where), _summary(frame)
    return _summary(where), ""


class _Site(NamedTuple):
    """The static description of one equation that went wrong."""

    order: int
    primitive: str
    where: str
    called_from: str
    dtype: str
    size: int
    transpose: bool


class _Shadow(interpret.Interpreter):
    """Evaluates a jaxpr on pairs ``(value, float32 shadow)`` and records what goes wrong.

    Records go through ``jax.debug.callback`` inside traced bodies (``scan``,
    ``cond``, ``checkpoint``...) and directly at the top level, which runs
    eagerly.
    """

    def __init__(self):
        super().__init__()
        self.sites: list[_Site] = []
        self.site_of: dict[tuple[int, int], int] = {}
        self.records: dict[tuple[int, str], dict] = {}
        self.transposing = 0
        self.enclosing: list[Any] = []  # the higher-order equations being evaluated

    # Values are pairs.
    def literal(self, lit):
        x = jnp.asarray(lit.val, lit.aval.dtype)
        return (x, _widen(x))

    def const(self, array):
        return (array, _widen(array))

    def to_original(self, value, aval):
        return value[0]

    def from_original(self, array, like):
        return None if array is None else (array, _widen(array))

    def eval_eqn(self, eqn, invals):
        transpose = "transpose" in str(eqn.source_info.name_stack)
        self.transposing += transpose
        self.enclosing.append(eqn)
        try:
            return super().eval_eqn(eqn, invals)
        finally:
            self.transposing -= transpose
            self.enclosing.pop()

    def first_order(self, eqn, invals):
        halves = [h for h, _ in invals]
        shadows = [s for _, s in invals]
        outs = interpret.bind(eqn, halves)
        shadow_outs = self._shadow(eqn, halves, shadows, outs)
        self._check(eqn, invals, outs, shadow_outs)
        return list(zip(outs, shadow_outs))

    def _shadow(self, eqn, halves, shadows, outs):
        name = eqn.primitive.name
        params = dict(eqn.params)
        widened = False
        for key in _DTYPE_PARAMS:
            if params.get(key) is not None and casting.is_half_dtype(params[key]):
                params[key] = casting.wide_dtype(params[key])
                widened = True
        if not widened and all(h is s for h, s in zip(halves, shadows)):
            return outs  # nothing half-precision goes in: the shadow is the value itself
        if name == "reduce_precision":
            return list(shadows)
        if name in _SCATTERS:
            # Their reduction is a jaxpr typed for the half dtype: let lax build a float32 one.
            keep = ("dimension_numbers", "indices_are_sorted", "unique_indices", "mode")
            return [_SCATTERS[name](*shadows, **{k: params[k] for k in keep if k in params})]
        if any(isinstance(v, (jex_core.Jaxpr, jex_core.ClosedJaxpr)) or callable(v)
               for v in params.values()):
            return [_widen(o) for o in outs]  # a typed sub-computation: the shadow follows
        try:
            shadow_outs = interpret.bind(eqn, shadows, params)
        except Exception:  # pylint: disable=broad-except  (a primitive that insists on its dtypes)
            return [_widen(o) for o in outs]
        expected = [casting.wide_dtype(o.dtype) if casting.is_float_dtype(o.dtype) else o.dtype
                    for o in outs]
        if [s.dtype for s in shadow_outs] != expected:
            return [_widen(o) for o in outs]
        return shadow_outs

    def _site(self, eqn, index: int, out) -> int:
        key = (id(eqn), index)
        if key not in self.site_of:
            where, called_from = _locate(eqn, self.enclosing[:-1])
            self.site_of[key] = len(self.sites)
            self.sites.append(_Site(len(self.sites), eqn.primitive.name, where, called_from,
                                    np.dtype(out.dtype).name, int(np.prod(out.shape)),
                                    self.transposing > 0))
        return self.site_of[key]

    def _check(self, eqn, invals, outs, shadow_outs):
        float_in = [(h, s) for h, s in invals if casting.is_float_array(h) and h.size]
        in_h = [h for h, _ in float_in]
        in_s = [s for _, s in float_in]
        for i, (h, s) in enumerate(zip(outs, shadow_outs)):
            if not casting.is_float_array(h) or h.size == 0:
                continue
            site = self._site(eqn, i, h)
            if any(isinstance(x, jax.core.Tracer) for x in (*in_h, *in_s, h, s)):
                # Inside a loop, cond, checkpoint or custom rule: check on the host at run time.
                jax.debug.callback(functools.partial(self._host_check, site), in_h, in_s, h, s)
            else:
                self._host_check(site, in_h, in_s, h, s)

    def _host_check(self, site, in_h, in_s, h, s):
        stats = _stats(*jax.device_get((in_h, in_s, h, s)))
        if stats[0]:
            self._record(site, *stats[1:])

    def _record(self, site, created, shadow_finite, nonfinite, underflow, half_max, f32_max,
                f32_min, in_max):
        created, shadow_finite = bool(created), bool(shadow_finite)
        if created:
            if shadow_finite and f32_max >= _SENTINEL and not np.isnan(half_max):
                return  # e.g. jnp.where(mask, logits, -1e30): -inf in half precision, by design
            kind, count = ("overflow" if shadow_finite else "float32 too"), int(nonfinite)
        else:
            kind, count = "underflow", int(underflow)
            if count < _UNDERFLOW_FRACTION * self.sites[site].size:
                return  # a few tiny values flushed to zero: rounding, not a problem
        key = (site, kind)
        if key not in self.records:  # the first time (e.g. the first scan iteration) is kept
            self.records[key] = dict(count=count, half_max=float(half_max),
                                     float32_max=float(f32_max), float32_min=float(f32_min),
                                     input_max=float(in_max))


def _f32(x) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def _stats(in_h: list, in_s: list, h: np.ndarray, s: np.ndarray) -> tuple:
    """What went wrong in one result ``h`` (shadow ``s``) of an operation on ``in_h`` (``in_s``).

    Computed on the host with NumPy. Returns ``(interesting, created,
    shadow_finite, nonfinite, underflow, half_max, float32_max, float32_min,
    input_max)``.
    """
    in_finite, in_underflow, in_max = True, False, 0.0
    for hi, si in zip(in_h, in_s):
        hi, si = _f32(hi), _f32(si)
        in_finite = in_finite and bool(np.isfinite(hi).all())
        in_underflow = in_underflow or bool(((hi == 0) & (si != 0)).any())
        finite = np.abs(si[np.isfinite(si)])
        in_max = max(in_max, float(finite.max()) if finite.size else 0.0)
    half_dtype = np.asarray(h).dtype
    h, s = _f32(h), _f32(s)
    nonfinite = int((~np.isfinite(h)).sum())
    shadow_finite = bool(np.isfinite(s).all())
    underflow = 0
    if casting.is_half_dtype(half_dtype):
        tiny = float(jnp.finfo(half_dtype).smallest_subnormal)
        underflow = int(((h == 0) & (s != 0) & (np.abs(s) < tiny)).sum())
    created = in_finite and nonfinite > 0
    interesting = created or (in_finite and not in_underflow and underflow > 0)
    if not interesting:
        return (False,) * 9
    abs_h, abs_s = np.abs(h), np.abs(s)
    finite_s = abs_s[np.isfinite(abs_s)]
    nonzero_s = abs_s[abs_s > 0]
    return (interesting, created, shadow_finite, nonfinite, underflow,
            float(np.where(np.isnan(abs_h), np.inf, abs_h).max()),
            float(finite_s.max()) if finite_s.size else 0.0,
            float(nonzero_s.min()) if nonzero_s.size else 0.0, in_max)


def _hint(site: _Site, phase: str, kind: str, stats: dict, scale: float, half: np.dtype,
          autocast: bool) -> str:
    half_max = float(jnp.finfo(half).max)
    prim = site.primitive
    if autocast:
        float32 = ("run this code in float32 (jaxmp.force_full_precision around it, or "
                   "autocast's full_precision rules), or compute_dtype=jnp.bfloat16")
    else:
        float32 = ("run this code in float32: mp_value_and_grad(..., autocast=True), "
                   "jaxmp.force_full_precision around it, or compute_dtype=jnp.bfloat16")
    if kind == "float32 too":
        return ("float32 overflows here as well (e.g. log(0), x/0, a diverging model): "
                "not a precision problem; fix the computation or the inputs")
    if kind == "underflow":
        if phase == "backward":
            return (f"gradients below {half.name}'s smallest value flush to zero: a larger "
                    "loss scale (the dynamic scaler grows it after growth_interval finite "
                    "steps), or float32 for this code")
        return f"values below {half.name}'s range flush to zero: {float32}"
    if phase == "forward":
        if prim == "convert_element_type":
            return (f"a value computed in float32 (a sum, a variance, a mean...) does not fit "
                    f"in {half.name} ({half_max:g}) when cast back: {float32}")
        if prim in _SUMS:
            return f"a sum or product that outgrows {half.name} ({half_max:g}): {float32}"
        if prim in _EXPS:
            return f"an exponential or power that outgrows {half.name}: {float32}"
        return f"the result outgrows {half.name} ({half_max:g}): {float32}"
    if not site.transpose:
        what = ("the derivative rule of a 1/x-like function (rsqrt, sqrt, division, log, pow "
                "of a small value; e.g. rsqrt(var)/var in a normalisation)"
                if prim in _SINGULAR else "a derivative rule's own arithmetic")
        return (f"computed by {what}, before any cotangent: it does not depend on the loss "
                f"scale, so no scale fixes it. Fix: {float32}")
    # Operations on cotangents are linear in them: at scale 1 everything is 1/scale as large.
    unscaled = max(stats["float32_max"], stats["input_max"]) / scale
    if unscaled < half_max:
        return (f"a cotangent scaled by {scale:g} outgrows {half.name}; at scale 1 it would be "
                f"{unscaled:.3g}: a smaller loss scale avoids it (the dynamic scaler backs off "
                "by itself), or keep this code in float32")
    return (f"even unscaled the cotangent reaches {unscaled:.3g} > {half_max:g}: no loss scale "
            f"fixes it. Fix: {float32}")


def _run(closed, flat_args) -> tuple[_Shadow, list]:
    """Evaluates ``closed`` on pairs, eagerly, and returns the interpreter with its records.

    Eagerly, every operation runs on its own and its result is rounded to its
    dtype, as the program is written.
    """
    shadow = _Shadow()
    outs = shadow.eval_closed(closed, [(x, _widen(x)) for x in flat_args])
    jax.effects_barrier()  # every record from inside loops is in before the report is read
    return shadow, outs


def _collect(shadow: _Shadow, phase_of: Callable, scale: float, half: np.dtype,
             skip: set, autocast: bool) -> list[Finding]:
    findings = []
    for (site_id, kind), stats in sorted(shadow.records.items()):
        site = shadow.sites[site_id]
        key = (site.primitive, site.where, site.dtype, site.size, kind)
        if key in skip:
            continue
        phase = phase_of(site)
        findings.append(Finding(
            phase, kind, site.primitive, site.where, site.called_from, site.dtype,
            stats["count"], site.size, stats["half_max"], stats["float32_max"],
            stats["float32_min"], site.transpose,
            _hint(site, phase, kind, stats, scale, half, autocast)))
    kept, per = [], {}
    for f in findings:
        per[(f.phase, f.kind)] = per.get((f.phase, f.kind), 0) + 1
        if per[(f.phase, f.kind)] <= (_MAX_UNDERFLOWS if f.kind == "underflow" else _MAX_PER_PASS):
            kept.append(f)
    return kept


def find_nonfinite(
    loss_fn: Callable,
    compute_dtype: Any = jnp.float16,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    autocast: bool = False,
    no_cast_argnums: int | Sequence[int] = (),
    matmul_dtype: Any = None,
) -> Callable[..., NonfiniteReport]:
    """Finds the operations that overflow in half precision, forward and backward.

    The returned function takes the arguments of ``loss_fn`` and an optional
    keyword ``scaler_state``, and builds the scaled loss and its gradient
    exactly as :func:`jaxmp.mp_value_and_grad` with the same options would
    (same casts, same scale). It then evaluates them one operation at a time
    beside a float32 shadow of the same computation and reports, for the
    forward and the backward pass, the operations whose inputs were finite
    and whose half-precision result is inf or NaN while the float32 shadow is
    finite, and those where at least 1% of the result flushed to zero while
    float32 has non-zero values; each with the Python line it comes from, the magnitudes in
    half precision and in float32, and a hint.

    It is a debugging tool: it runs eagerly, operation by operation, and is
    slow on a large model (give it one batch). It does not change anything:
    the training step is untouched. Control flow (``cond``, ``while``) follows
    the half-precision values. Float32 values beyond 1e30 are taken for
    sentinels (a mask's ``-1e30``) whose overflow to ``-inf`` is intended.

    Args:
        loss_fn: the loss function, as given to :func:`jaxmp.mp_value_and_grad`.
        compute_dtype: ``jnp.float16`` (default) or ``jnp.bfloat16``.
        argnums: the differentiated positional arguments.
        has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
        autocast: check ``jaxmp.autocast(loss_fn)`` instead of casting the
            inputs, as ``mp_value_and_grad(..., autocast=True)`` does.
        no_cast_argnums: arguments passed uncast, as in
            :func:`jaxmp.mp_value_and_grad`.
        matmul_dtype: with ``autocast=True``, a float8 dtype for the matrix
            products, as in :func:`jaxmp.mp_value_and_grad`. The float32
            shadow of a float8 product is the exact float32 product, so a
            product whose float8 result goes wrong is reported at its line.

    Returns:
        A function ``(*args, scaler_state=None, **kwargs) -> NonfiniteReport``.
        Without ``scaler_state``, the scale is that of a fresh
        ``jaxmp.init_scaler()`` for float16 and 1 for bfloat16. Pass the
        scaler state of a stuck run to check the scale it is stuck at.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> def loss_fn(w, x):
        ...     return jnp.mean(jnp.exp(x @ w))
        >>> w, x = jnp.full((4,), 3.0), jnp.ones((2, 4))
        >>> report = jaxmp.find_nonfinite(loss_fn)(w, x)  # exp(12) > 65504
        >>> bool(report), report.findings[0].phase, report.findings[0].primitive
        (True, 'forward', 'exp')
    """
    # The very step mp_value_and_grad runs: same validation, casts and scaled loss.
    step = kernel.Step.create(
        loss_fn, api="jaxmp.find_nonfinite", argnums=argnums, no_cast_argnums=no_cast_argnums,
        has_aux=has_aux, compute_dtype=compute_dtype, use_mixed_precision=True, axis_name=None,
        autocast=autocast, matmul_dtype=matmul_dtype)
    half = casting.canonical_float_dtype(compute_dtype, allowed=casting.COMPUTE_DTYPES,
                                         what="compute_dtype")
    if not casting.is_half_dtype(half):
        raise ValueError("find_nonfinite compares half precision with float32: compute_dtype "
                         f"must be float16 or bfloat16, got {half.name}.")

    def report_fn(*args, scaler_state=None, **kwargs) -> NonfiniteReport:
        if scaler_state is None:
            state = loss_scale.init_scaler() if half == jnp.float16 else loss_scale.noop_scaler()
        else:
            state = step.check_state(scaler_state)
        diff, rebuild, _ = step.differentiable(args, state)

        def scaled_loss(d):
            return step.scaled_loss(state, rebuild(d), kwargs)[0]

        scale = 1.0 if state.mode == "none" else float(state.scale)
        flat = jax.tree_util.tree_leaves(diff)

        forward_jaxpr = jax.make_jaxpr(scaled_loss)(diff)
        fwd, (loss,) = _run(forward_jaxpr, flat)
        forward = _collect(fwd, lambda site: "forward", scale, half, set(), autocast)
        skip = {(f.primitive, f.where, f.dtype, f.size, f.kind) for f in forward}
        both_jaxpr = jax.make_jaxpr(jax.value_and_grad(scaled_loss))(diff)
        bwd, _ = _run(both_jaxpr, flat)
        backward = _collect(bwd, lambda site: "backward", scale, half, skip, autocast)
        return NonfiniteReport(tuple(forward + backward), half.name, scale,
                               float(loss[0]) / scale, float(loss[1]) / scale)

    return report_fn
