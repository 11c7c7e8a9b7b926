"""The float32 regions of an autocast program, recomputed in the backward pass.

With ``recompute_float32`` (the default for a half-precision compute dtype),
``autocast`` (``__init__.py``) traces the interpreter's program
(``interpreter.py``) and evaluates it again with ``eval_with_regions``: each
connected float32 region (a layer norm's statistics, a softmax's exponentials
and sums), with the half-precision operations that narrow its result, is
recomputed in the backward pass instead of saved, where its derivative is
taken. The recomputation is tied to the region's cotangents so that XLA
cannot move it into the forward pass; matrix products and collectives are
saved, never recomputed (``recompute_policy``). A ``scan``'s body gets its
regions too.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import casting
from jaxmp._src import compat
from jaxmp._src import interpret
from jaxmp._src import jaxprs
from jaxmp._src.autocast import rules as rules_lib

_COMMUNICATING = compat.COMMUNICATING  # saved for the backward pass, never recomputed
# Sums (linear, one output) whose values a recomputed region keeps from the forward pass.
_SAVED_SUMS = compat.LINEAR_REDUCTIONS


def recompute_policy(low: frozenset) -> Callable:
    """The ``jax.checkpoint`` policy of a float32 region: saves products, collectives, non-floats.

    A region's float32 intermediates (sums, exponentials, normalisation
    statistics, ...) and its half-precision tail (``_with_narrowing_tail``)
    are then recomputed in the backward pass from the region's inputs;
    matrix products and collectives (``_COMMUNICATING``) are always saved,
    never recomputed. The sums are recomputed too (one more pass over a
    region's input): a saved statistic would let XLA schedule what is
    computed from it in the forward pass, in float32 (see
    ``_recomputed_late``).
    """

    always = low | rules_lib.LOW_PRECISION

    def policy(prim, *avals, **params):
        if prim.name in always or prim.name in _COMMUNICATING:
            return True
        dtypes = [params.get(key) for key in ("new_dtype", "dtype") if params.get(key) is not None]
        dtypes += [getattr(a, "dtype", None) for a in avals]
        return not any(casting.is_float_dtype(d) for d in dtypes)

    policy.saved = always | _COMMUNICATING  # the primitives it saves whatever their dtypes
    return policy


def _float32_regions(jaxpr) -> list[list[int]]:
    """The float32 regions of the autocast program ``jaxpr``, as lists of equation indices.

    A region is a connected group of first-order equations with float32 (or
    wider) outputs, connected through float32 values: a layer-norm's
    statistics and normalisation, a softmax's exponentials and sums, the
    float32 part of a GELU, each with its narrowing tail
    (``_with_narrowing_tail``: the conversion of its result to half
    precision and a layer norm's scale and bias). A region is dropped when an
    equation outside it sits between its equations and reads one of its
    values (it could then not run as one unit); a tail is dropped when it
    makes that so.
    """
    def wide_out(eqn):
        return any(casting.is_float_dtype(v.aval.dtype) and np.dtype(v.aval.dtype).itemsize >= 4
                   for v in eqn.outvars)

    member = [eqn.primitive.name not in interpret.HANDLERS and wide_out(eqn)
              and not compat.is_higher_order(eqn, combiners=True)
              for eqn in jaxpr.eqns]
    uses = jaxprs.Uses(jaxpr, positions=True)
    producer, users = uses.producer, uses.users
    parent = list(range(len(jaxpr.eqns)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, eqn in enumerate(jaxpr.eqns):
        if not member[i]:
            continue
        for v in eqn.invars:
            j = producer.get(v) if not compat.is_literal(v) else None
            if j is not None and member[j] and np.dtype(v.aval.dtype).itemsize >= 4:
                parent[find(i)] = find(j)
    groups: dict[int, list[int]] = {}
    for i in range(len(jaxpr.eqns)):
        if member[i]:
            groups.setdefault(find(i), []).append(i)

    def runs_as_one(idx):  # no equation outside it reads its values before its last one
        inside, outs = set(idx), {v for i in idx for v in jaxpr.eqns[i].outvars}
        return not any(
            j not in inside and any(v in outs for v in jaxpr.eqns[j].invars
                                    if not compat.is_literal(v))
            for j in range(idx[0], idx[-1]))

    regions = []
    for idx in groups.values():
        if len(idx) < 2:
            continue
        with_tail = _with_narrowing_tail(jaxpr, idx, users)
        if with_tail != idx and runs_as_one(with_tail):
            regions.append(with_tail)
        elif runs_as_one(idx):
            regions.append(idx)
    return regions


# Elementwise operations that may continue a region's narrowing tail (``_with_narrowing_tail``).
_TAIL_OPS = compat.TAIL_OPS


def _with_narrowing_tail(jaxpr, idx: list[int], users: dict) -> list[int]:
    """Region ``idx`` extended with the half-precision operations that narrow and scale its outputs.

    The tail is the conversion of a region value to half precision and the
    elementwise operations that follow it with only small other operands
    (a layer norm's scale and bias): ``normalised * scale + bias``. Recomputed
    with the region, their results are not read from the forward pass by the
    backward one (the derivative of ``normalised * scale`` reads
    ``normalised``): XLA fuses a narrowing conversion into each of its users,
    so a backward pass reading the narrowed value keeps the region's float32
    value alive until then.
    """
    members, chain = set(idx), {v for i in idx for v in jaxpr.eqns[i].outvars}
    frontier = list(chain)
    while frontier:
        v = frontier.pop()
        for j in users.get(v, ()):
            eqn = jaxpr.eqns[j]
            if j in members or len(eqn.outvars) != 1:
                continue
            out = eqn.outvars[0].aval
            if not casting.is_narrow_dtype(getattr(out, "dtype", None)):
                continue
            if eqn.primitive.name == "convert_element_type":
                ok = np.dtype(v.aval.dtype).itemsize >= 4
            elif eqn.primitive.name in _TAIL_OPS:
                ours = [u for u in eqn.invars if not compat.is_literal(u) and u in chain]
                ok = (len(ours) == 1 and casting.is_narrow_dtype(v.aval.dtype)
                      and v.aval.shape == out.shape
                      and all(compat.is_literal(u) or u in chain
                              or u.aval.size < out.size for u in eqn.invars))
            else:
                ok = False
            if ok:
                members.add(j)
                chain.update(eqn.outvars)
                frontier.extend(eqn.outvars)
    return sorted(members)


def _recomputed_late(fn: Callable, policy: Callable) -> Callable:
    """``jax.checkpoint(fn, policy=policy)``, its recomputation tied to its cotangents.

    A checkpoint's recomputation depends only on values of the forward pass,
    so XLA is free to schedule it there (XLA:CPU does: it drops the
    optimisation barriers of ``prevent_cse`` before scheduling), and the
    float32 values it recomputes then live from the forward pass to the
    backward one, which is what recomputing was to avoid. Here each saved
    input of ``fn`` as large as its largest output gets ``0 * cotangent``
    added before the recomputation (the cotangent of an output of its shape,
    else the first element of one): a data dependence that XLA keeps
    (``0 * x`` is not simplified for floats), so the recomputation waits for
    the backward pass. The sum is exact for finite cotangents; a non-finite
    one makes the gradients non-finite, as it would anyway. The tie is what
    keeps the recomputation apart from the forward pass, so the checkpoint
    has no optimisation barriers (``prevent_cse=False``): on XLA:GPU a barrier
    is a fusion boundary, and with them every tied input was written out once
    more and a region's sums and tail could not fuse with their neighbours
    (the H100 program of a 2-layer GPT step: 1.22x the bytes written, 17 more
    kernels and 4% more scratch memory than without the barriers).

    Reverse-mode only (``jax.custom_vjp``): forward-mode differentiation of
    the result raises (autocast does not tie regions under forward mode, see
    :func:`autocast`).
    """
    remat = jax.checkpoint(fn, policy=policy, prevent_cse=False)

    @jax.custom_vjp
    def run(*xs):
        return fn(*xs)

    def fwd(*xs):
        return jax.vjp(remat, *xs)

    def bwd(vjp, cts):
        leaves, tree = jax.tree_util.tree_flatten(vjp)
        return tuple(jax.tree_util.tree_unflatten(tree, _tied(leaves, cts))(cts))

    run.defvjp(fwd, bwd)
    return run


def _recomputed_from_inputs(fn: Callable, backwards: dict | None = None,
                            key: Any = None) -> Callable:
    """``_recomputed_late`` for a region that saves nothing but its inputs and its statistics
    (no product, no collective in it): the forward pass runs ``fn`` as written and keeps its
    inputs and the values of its statistics (``_is_statistic``: a batch norm's sums, one
    number per channel); the backward pass differentiates ``fn`` afresh on them,
    the sums taken from the forward pass (``_known``) rather than computed again, tied to the
    cotangents. The same program as the checkpoint's, traced in half the time (a checkpoint
    is linearised in the forward pass and linearised again when it is transposed), without a
    second pass over the region's inputs for its statistics: on a GPU, every elementwise
    value the backward pass recomputes fuses into the kernels that read it, so recomputing a
    batch norm costs no kernel of its own, as in a hand-written step.

    ``fn(*xs, sums=None)`` returns ``(outputs, sums)``; given ``sums``, it uses them.

    With ``backwards`` (a dict) and ``key`` (the region's structure, ``_region_key``), the
    backward pass is traced once per structure and operand types and replayed for every
    region with that key: the identical layers of a deep model are differentiated once.
    """

    @jax.custom_vjp
    def run(*xs):
        return fn(*xs)[0]

    def fwd(*xs):
        outs, sums = fn(*xs)
        return outs, (xs, sums)

    def backward(xs, sums, cts):
        sums = _tied_sums(list(sums), cts)
        _, vjp = jax.vjp(lambda *xs: fn(*xs, sums=sums)[0], *_tied(list(xs), cts))
        return vjp(cts)

    def bwd(saved, cts):
        xs, sums = saved
        args = [*xs, *sums, *cts]
        split = (len(xs), len(xs) + len(sums))

        def from_args(*args):
            return backward(args[:split[0]], args[split[0]:split[1]], list(args[split[1]:]))

        if any(compat.varying_axes(a) for a in args):  # in a shard_map body: traced in place
            return tuple(from_args(*args))
        types = tuple((a.shape, a.dtype) for a in args)
        known = backwards if backwards is not None and key is not None else {}
        program = known.get((key, types))
        if program is None:
            traced = jax.make_jaxpr(from_args)(
                *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args])
            # Without the recomputed outputs nothing reads (find_nonfinite would take
            # them for gradients, the program's ends).
            program = known[key, types] = (
                compat.without_dead_code(traced.jaxpr, keep_inputs=True), traced.consts)
        return tuple(compat.eval_jaxpr(*program, *args))

    run.defvjp(fwd, bwd)
    return run


def _is_statistic(eqn) -> bool:
    """Whether ``eqn`` is a sum whose value a recomputed region keeps: a statistic over leading
    axes (a batch norm's, over the batch and the positions of each channel), at least eight
    times smaller than what it sums. XLA sums those in kernels of their own, which the
    backward pass would launch again; a sum over the last axis (a layer norm's, a softmax's)
    it fuses with what reads it, one row at a time, so it is summed again as before (kept,
    it costs a transformer's step kernels: 225 against 186 on the 2-block GPT's H100 program).
    """
    if eqn.primitive.name not in _SAVED_SUMS or len(eqn.outvars) != 1:
        return False
    operand = eqn.invars[0].aval
    axes = compat.some_params(eqn, ("axes",)).get("axes", ())
    return (operand.ndim - 1 not in tuple(axes)
            and 8 * eqn.outvars[0].aval.size <= operand.size)


def _known(eqn, invals: list, value):
    """``eqn`` (a sum: linear in its operands) on ``invals``, its value ``value`` already
    known from the forward pass: ``value`` itself, with the sum's derivative (the sum of the
    tangents; transposed, a broadcast of the cotangent). The operands are not summed again."""

    @jax.custom_jvp
    def known(value, *xs):
        del xs
        return value

    @known.defjvp
    def known_jvp(primals, tangents):
        value, *_ = primals
        _, *dxs = tangents
        return value, interpret.bind(eqn, dxs)[0]

    return known(value, *invals)


def _region_key(jaxpr, region: list[int], inputs: list, outputs: list) -> Any:
    """What a region computes, as a hashable key: two regions with the same key compute the
    same function of their inputs (primitives, parameters, literals, wiring, operand types),
    written on the same lines of the user's code, callers included, under the same names
    (``jax.named_scope``, a framework's module path): the source the backward pass carries.
    The layers of a loop share one; a framework's layers, named each its own, do not.
    ``None`` when a parameter cannot be a key."""
    position = {v: ("in", k) for k, v in enumerate(inputs)}
    parts = []
    try:
        for n, j in enumerate(region):
            eqn = jaxpr.eqns[j]
            ins = tuple(("lit", repr(v.val), str(v.aval)) if compat.is_literal(v)
                        else position[v] for v in eqn.invars)
            frames = compat.user_frames(compat.traceback(eqn))
            where = (tuple((f.file_name, f.start_line) for f in frames), compat.name_stack(eqn))
            parts.append((compat.params_key(eqn), ins,
                          tuple(str(v.aval) for v in eqn.outvars), where))
            position.update({v: ("eqn", n, k) for k, v in enumerate(eqn.outvars)})
        parts.append(tuple(position[v] for v in outputs))
        key = tuple(parts)
        hash(key)
    except (TypeError, KeyError):
        return None
    return key


def _tied(values: list, cts) -> list:
    """``values`` (a region's saved inputs), those of floats as large as its largest cotangent
    with ``0 * cotangent`` added (see ``_recomputed_late``)."""
    floats = [c for c in cts if casting.is_float_dtype(c.dtype) and c.size]
    if not floats:
        return values
    largest = max(c.size for c in floats)
    by_shape = {c.shape: c for c in reversed(floats)}

    def tie(x):
        if not casting.is_float_dtype(getattr(x, "dtype", None)) or x.size < largest:
            return x
        # Elementwise when shapes agree: fewer instructions for XLA to copy
        # into every fusion that reads ``x`` than a broadcast scalar.
        c = by_shape.get(x.shape, _first(floats[0]))
        return x + (c * 0).astype(x.dtype)

    return [tie(x) for x in values]


def _first(c):
    """The first element of ``c``, a slice of it (``c.ravel()[0]`` slices a reshape, which
    XLA's GPU program reads as a slice too, but which ``gpu_program`` counts as a read of all
    of ``c``)."""
    return c[(0,) * c.ndim]


def _tied_sums(sums: list, cts) -> list:
    """A region's saved sums (small), each with ``0 * cotangent`` added (a scalar of one):
    what the backward pass computes from them waits for it too (``_recomputed_late``)."""
    floats = [c for c in cts if casting.is_float_dtype(c.dtype) and c.size]
    if not floats:
        return sums
    zero = _first(floats[0]) * 0
    return [x + zero.astype(x.dtype) for x in sums]


def eval_with_regions(closed, args, policy) -> list:
    """Evaluates ``closed`` with each float32 region in its own checkpoint (``_recomputed_late``).

    Each region's float32 values are then recomputed in the backward pass
    where that region's derivative is taken, one region at a time, rather
    than all at the start of the backward pass or in the forward pass.
    """
    jaxpr = closed.jaxpr
    regions = _float32_regions(jaxpr)
    backwards: dict = {}  # per region structure, its traced backward pass
    region_of = {i: r for r in regions for i in r}
    used_after: dict[int, set] = {}
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, args))
    outside_uses = {v for v in jaxpr.outvars if not compat.is_literal(v)}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not compat.is_literal(v):
                used_after.setdefault(id(v), set()).add(i)

    def read(v):
        return jnp.asarray(v.val, v.aval.dtype) if compat.is_literal(v) else env[v]

    for i, eqn in enumerate(jaxpr.eqns):
        region = region_of.get(i)
        if region is None:
            invals = [read(v) for v in eqn.invars]
            if eqn.primitive.name == "scan":
                outs = _scan_with_regions(eqn, invals, policy)
            else:
                outs = interpret.bind(eqn, invals)
            env.update(zip(eqn.outvars, outs))
            continue
        if i != region[-1]:
            continue
        inside = set(region)
        produced = [v for j in region for v in jaxpr.eqns[j].outvars]
        produced_set = set(produced)
        inputs = list(dict.fromkeys(
            v for j in region for v in jaxpr.eqns[j].invars
            if not compat.is_literal(v) and v not in produced_set))
        outputs = [v for v in produced
                   if v in outside_uses or used_after.get(id(v), set()) - inside]

        sums = [j for j in region if _is_statistic(jaxpr.eqns[j])]

        def run_region(*xs, region=region, inputs=inputs, outputs=outputs, sums=sums,
                       known=None):
            local = dict(zip(inputs, xs))
            values = dict(zip(sums, known or ()))

            def get(v):
                return jnp.asarray(v.val, v.aval.dtype) if compat.is_literal(v) else local[v]

            for j in region:
                e = jaxpr.eqns[j]
                ins = [get(v) for v in e.invars]
                outs = (interpret.bind(e, ins) if j not in values
                        else [_known(e, ins, values[j])])
                local.update(zip(e.outvars, outs))
            return [local[v] for v in outputs], [local[jaxpr.eqns[j].outvars[0]] for j in sums]

        try:
            saves = any(jaxpr.eqns[j].primitive.name in policy.saved for j in region)
            recomputed = (_recomputed_late(lambda *xs, f=run_region: f(*xs)[0], policy) if saves
                          else _recomputed_from_inputs(
                              lambda *xs, f=run_region, sums=None: f(*xs, known=sums),
                              backwards, _region_key(jaxpr, region, inputs, outputs)))
            outs = recomputed(*[env[v] for v in inputs])
        except TypeError as e:
            if "forward-mode" not in str(e):
                raise
            raise TypeError(_FORWARD_MODE_MESSAGE) from e
        env.update(zip(outputs, outs))
    return [read(v) for v in jaxpr.outvars]


def _scan_with_regions(eqn, invals: list, policy) -> list:
    """A ``scan`` equation bound with its body's float32 regions recomputed (``eval_with_regions``).

    Without it, the reverse pass of a scanned model keeps each iteration's
    float32 intermediates (normalisation statistics, softmax exponentials):
    stacked over the iterations, more memory than the hand-written
    half-precision step, where the unrolled model needs less. A body that
    closes over values (up to jax 0.10 ``lax.scan`` passes them as operands),
    or a scan whose parameters jaxmp does not know (autocast ran it as
    written and said so), is bound as it is.
    """
    try:
        body = compat.scan(eqn).body
    except compat.UnknownEquation:
        return interpret.bind(eqn, invals)
    if body.consts:
        return interpret.bind(eqn, invals)
    program = jax.make_jaxpr(lambda *xs: eval_with_regions(body, xs, policy))(
        *[compat.abstract_like(a) for a in body.in_avals])
    if program.consts:
        return interpret.bind(eqn, invals)
    return interpret.bind(eqn, invals, compat.scan_with_body(eqn, program))


_FORWARD_MODE_MESSAGE = (
    "jaxmp.autocast: forward-mode differentiation (jax.jvp, jax.jacfwd, jax.hessian) reached a "
    "float32 region that autocast recomputes in the backward pass (recompute_float32=True, the "
    "default for a half-precision compute_dtype). That recomputation is a jax.custom_vjp, which "
    "JAX differentiates in reverse mode only (jax.grad, jax.vjp).\n"
    "  Fix: jaxmp.autocast(fn, compute_dtype, recompute_float32=False) for a function "
    "differentiated in forward mode: it keeps the float32 intermediates instead of recomputing "
    "them (more memory in the backward pass, the same values).")
