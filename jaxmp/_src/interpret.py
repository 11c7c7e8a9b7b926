"""Evaluating a jaxpr again, one equation at a time: the shared interpreter.

``autocast`` and ``find_nonfinite`` both walk a jaxpr equation by equation,
each with its own behaviour per first-order equation, and both must recurse
into the higher-order primitives (nested ``jit``, ``scan``, ``while``,
``cond``, ``checkpoint``, ``custom_jvp_call``, ``custom_vjp_call``). This
module holds that walk once.

The API:

* :class:`Interpreter` holds the environment walk (:meth:`~Interpreter.eval_jaxpr`,
  :meth:`~Interpreter.eval_closed`) and dispatches each equation
  (:meth:`~Interpreter.eval_eqn`): to the handler registered for its
  primitive name in ``interpreter.handlers`` if there is one, otherwise to
  :meth:`~Interpreter.first_order`. A client subclasses it and overrides
  ``first_order``; it may also pass its own handler table (start from
  :data:`HANDLERS`, e.g. ``{**interpret.HANDLERS, "scan": my_scan}``).
* The *values* the interpreter moves around are the client's: any pytree of
  arrays (a bare array by default; a pair ``(value, shadow)``; an array
  wrapped in a pytree node whose static auxiliary data marks it). The
  handlers pass them through ``lax.scan``, ``lax.while_loop``,
  ``lax.switch``, ``jax.checkpoint``, ``jax.custom_jvp`` and
  ``jax.custom_vjp`` as pytrees, so static information a client keeps in a
  pytree node's auxiliary data comes back out of traced bodies by itself,
  with no side channel.
* The handlers ask the client a few questions, as methods with neutral
  defaults: :meth:`~Interpreter.literal` and :meth:`~Interpreter.const`
  (the value of a jaxpr literal or of a ``ClosedJaxpr`` constant),
  :meth:`~Interpreter.loop_carry` (loop carries, at entry and after each
  iteration: they must keep one type), :meth:`~Interpreter.unify_branches`
  (``cond`` outputs when branches disagree), :meth:`~Interpreter.to_original`
  and :meth:`~Interpreter.from_original` (the array the original program
  would see, for custom derivative rules, and back).
* :func:`bind` binds an equation's primitive on arrays, as
  ``jax.core.eval_jaxpr`` does.
* An equation the interpreter does not understand (parameters a JAX release
  changed, or a higher-order primitive without a handler) runs as written
  (:meth:`~Interpreter.as_written`), and a
  :class:`~jaxmp.debug.UnknownEquationWarning` names its primitive once.

A handler is ``handler(interpreter, eqn, invals) -> list of outvals``; it
calls ``interpreter.eval_closed`` (or ``eval_jaxpr``) on the sub-jaxprs.

Example: an interpreter that runs a function as written while recording the
first-order primitives it meets, nested ``jit`` included:

>>> import jax, jax.numpy as jnp
>>> from jaxmp._src import interpret
>>> class Recorder(interpret.Interpreter):
...     def __init__(self):
...         super().__init__()
...         self.names = []
...     def first_order(self, eqn, invals):
...         self.names.append(eqn.primitive.name)
...         return interpret.bind(eqn, invals)
>>> closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) * 2.0)(1.0)
>>> recorder = Recorder()
>>> (out,) = recorder.eval_closed(closed, [jnp.float32(0.5)])
>>> recorder.names, round(float(out), 4)
(['sin', 'mul'], 0.9589)
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxmp._src import compat
from jaxmp._src import jaxprs
from jaxmp._src import messages

Handler = Callable[["Interpreter", Any, list], list]


#: Equations bound inside this block carry the source of ``eqn``: the user's line and names
#: (:func:`jaxmp._src.compat.at_source_of`).
at_source_of = compat.at_source_of


def bind(eqn, invals: Sequence[Any], params: Mapping[str, Any] | None = None) -> list[Any]:
    """Binds the primitive of ``eqn`` on ``invals`` (arrays); always returns a list.

    The new equation keeps the source location of ``eqn`` (the user's line),
    not this function's, so that a program rewritten by an interpreter still
    points at the user's code.
    """
    return compat.bind(eqn, invals, params)


class Interpreter:
    """Evaluates jaxprs equation by equation; subclass it to change what an equation does.

    Args:
        handlers: primitive name -> handler for the primitives that are not
            evaluated by :meth:`first_order` (default :data:`HANDLERS`).
    """

    def __init__(self, handlers: Mapping[str, Handler] | None = None):
        self.handlers = HANDLERS if handlers is None else handlers

    # --- The walk ------------------------------------------------------------------------

    def eval_jaxpr(self, jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        """The outputs of ``jaxpr`` (an open ``Jaxpr``) on ``consts`` and ``args`` (values)."""
        env: dict[Any, Any] = {}

        def read(v):
            return self.literal(v) if compat.is_literal(v) else env[v]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn in jaxpr.eqns:
            outs = self.eval_eqn(eqn, [read(v) for v in eqn.invars])
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def eval_closed(self, closed, args: Sequence[Any]) -> list[Any]:
        """The outputs of a ``ClosedJaxpr`` on ``args``; its constants go through :meth:`const`."""
        return self.eval_jaxpr(closed.jaxpr, [self.const(c) for c in closed.consts], args)

    def eval_eqn(self, eqn, invals: list) -> list:
        """One equation: its handler if its primitive has one, else :meth:`first_order`.

        An equation whose parameters are not what jaxmp knows
        (:class:`~jaxmp._src.compat.UnknownEquation`) runs :meth:`as_written`;
        a higher-order one without a handler goes to :meth:`first_order` (which
        cannot look inside it). Both say so once per primitive.
        """
        handler = self.handlers.get(eqn.primitive.name)
        try:
            if handler is not None:
                with compat.inside_call(eqn):  # its body keeps the user's line and names
                    return handler(self, eqn, invals)
            if compat.is_higher_order(eqn):
                _warn_unknown(eqn, "jaxmp has no rule for its body")
            return self.first_order(eqn, invals)
        except compat.UnknownEquation as e:
            _warn_unknown(eqn, f"{e}; the JAX installed, {jax.__version__}, may be newer than "
                               "this jaxmp")
            return self.as_written(eqn, invals)

    def as_written(self, eqn, invals: list) -> list:
        """``eqn`` run exactly as written: on the original arrays (:meth:`to_original`), its
        results given back as values (:meth:`from_original`)."""
        outs = bind(eqn, [self.to_original(x, v.aval) for x, v in zip(invals, eqn.invars)])
        return [self.from_original(o, jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype))
                for o, v in zip(outs, eqn.outvars)]

    # --- What a client overrides -----------------------------------------------------------

    def first_order(self, eqn, invals: list) -> list:
        """An equation without a handler; by default, runs it as written."""
        return bind(eqn, invals)

    def literal(self, lit) -> Any:
        """The value of a jaxpr ``Literal``."""
        return jnp.asarray(lit.val, lit.aval.dtype)

    def const(self, array) -> Any:
        """The value of a constant (an array) of a ``ClosedJaxpr``."""
        return array

    def loop_carry(self, values: list, avals: Sequence[Any]) -> list:
        """Loop carries (``scan``, ``while``) on entry and after every iteration.

        A loop needs one type for its carry: the result must not depend on
        whether it is called on the initial values or on a body's outputs.
        ``avals`` are the carries' types in the original program.
        """
        del avals
        return values

    def unify_branches(self, branch_shapes: Sequence[list], avals: Sequence[Any]) -> Callable:
        """How to bring the outputs of every ``cond`` branch to one type.

        Args:
            branch_shapes: per branch, its outputs as ``jax.eval_shape`` gives
                them (same pytrees as the values, ``ShapeDtypeStruct`` leaves).
            avals: the outputs' types in the original program.

        Returns:
            A function applied to each branch's list of outputs. The default
            casts a leaf whose dtype differs between branches to the
            original dtype.
        """
        leaves = [[jax.tree_util.tree_leaves(o) for o in shapes] for shapes in branch_shapes]

        def fix(outs):
            fixed = []
            for i, (out, aval) in enumerate(zip(outs, avals)):
                dtypes = [{l.dtype for l in per_branch[i]} for per_branch in leaves]
                if all(d == dtypes[0] for d in dtypes):
                    fixed.append(out)
                else:
                    fixed.append(jax.tree_util.tree_map(
                        lambda x, a=aval: lax.convert_element_type(x, a.dtype), out))
            return fixed

        return fix

    def to_original(self, value: Any, aval: Any) -> Any:
        """The array the original program has where the client has ``value``.

        Used to run a custom derivative rule as written; also applied to
        tangents and cotangents, which have the pytree structure of values.
        """
        del aval
        return value

    def from_original(self, array: Any, like: Any) -> Any:
        """The inverse of :meth:`to_original`, shaped like the client value ``like``.

        Used for the tangents and cotangents that a custom rule returns.
        ``like`` is a value, or a skeleton of one (``ShapeDtypeStruct``
        leaves): use only its structure and dtypes. A cotangent for an
        integer input may be returned as ``None``.
        """
        del like
        return array


def _warn_unknown(eqn, why: str) -> None:
    name = eqn.primitive.name
    messages.warn_once(
        ("unknown equation", name),
        f"jaxmp does not understand a {name} equation ({why}), so it runs as written, in its "
        f"own dtypes: nothing inside it is autocast or diagnosed. Call jaxmp's function inside "
        f"it instead, upgrade jaxmp, or report the {name} primitive.",
        compat.UnknownEquationWarning)


# --- The handlers of higher-order primitives ------------------------------------------------


def _call(interp: Interpreter, eqn, invals):
    return interp.eval_closed(compat.closed(compat.called_jaxpr(eqn)), invals)


def _checkpoint(interp: Interpreter, eqn, invals):
    p = compat.checkpoint(eqn)

    def body(*xs):
        return interp.eval_jaxpr(p.body, (), xs)

    return list(jax.checkpoint(body, prevent_cse=p.prevent_cse, policy=p.policy)(*invals))


def _scan(interp: Interpreter, eqn, invals):
    p = compat.scan(eqn)
    nc, ncarry = p.num_consts, p.num_carry
    carry_avals = [v.aval for v in eqn.invars[nc:nc + ncarry]]
    consts, init, xs = invals[:nc], invals[nc:nc + ncarry], invals[nc + ncarry:]

    def step(carry, x):
        outs = interp.eval_closed(p.body, [*consts, *carry, *x])
        return interp.loop_carry(outs[:ncarry], carry_avals), outs[ncarry:]

    carry, ys = lax.scan(
        step, interp.loop_carry(list(init), carry_avals), list(xs), length=p.length,
        reverse=p.reverse, unroll=p.unroll, _split_transpose=p.split_transpose,
    )
    return [*carry, *ys]


def _while(interp: Interpreter, eqn, invals):
    p = compat.while_loop(eqn)
    cn, bn = p.cond_nconsts, p.body_nconsts
    cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
    carry_avals = [v.aval for v in eqn.invars[cn + bn:]]

    def cond_fun(carry):
        (pred,) = interp.eval_closed(p.cond, [*cconsts, *carry])
        return interp.to_original(pred, p.cond.out_avals[0])

    def body_fun(carry):
        outs = interp.eval_closed(p.body, [*bconsts, *carry])
        return interp.loop_carry(outs, carry_avals)

    return list(lax.while_loop(cond_fun, body_fun, interp.loop_carry(list(init), carry_avals)))


def _cond(interp: Interpreter, eqn, invals):
    branches = compat.cond_branches(eqn)
    index, ops = invals[0], invals[1:]
    avals = [v.aval for v in eqn.outvars]

    def run(closed):
        return lambda *xs: interp.eval_closed(closed, xs)

    shapes = [jax.eval_shape(run(b), *ops) for b in branches]
    fix = interp.unify_branches(shapes, avals)

    def final(closed):
        return lambda *xs: fix(interp.eval_closed(closed, xs))

    index = interp.to_original(index, eqn.invars[0].aval)
    return list(lax.switch(index, [final(b) for b in branches], *ops))


def _custom_parts(interp: Interpreter, eqn):
    """The body under ``interp`` and the call as written, in the original dtypes."""
    in_avals = [v.aval for v in eqn.invars]

    body = compat.closed(compat.called_jaxpr(eqn))

    def primal(*xs):
        return interp.eval_closed(body, xs)

    def original(*xs):
        # Run from within the evaluation of ``eqn`` (or traced later under the names of the
        # call that replaces it), whose names are already there.
        return compat.bind(eqn, xs, own_names=False)

    def to_original(values):
        return [interp.to_original(x, a) for x, a in zip(values, in_avals)]

    return primal, original, to_original


def _custom_jvp(interp: Interpreter, eqn, invals):
    """The primal runs under ``interp``; the derivative is the function's own rule, as written."""
    primal, original, to_original = _custom_parts(interp, eqn)
    fun = jax.custom_jvp(primal)

    @fun.defjvp
    def _(primals, tangents):
        outs = fun(*primals)
        _, out_tangents = jax.jvp(original, tuple(to_original(primals)), tuple(to_original(tangents)))
        return outs, [interp.from_original(t, o) for t, o in zip(out_tangents, outs)]

    return list(fun(*invals))


def _custom_vjp(interp: Interpreter, eqn, invals):
    """The primal runs under ``interp``; the derivative is the function's own rule, as written.

    Under differentiation the original forward rule runs too, to produce the
    residuals its backward rule expects; what of it the residuals do not need
    is removed by dead-code elimination.
    """
    primal, original, to_original = _custom_parts(interp, eqn)
    out_avals = [v.aval for v in eqn.outvars]
    # The input cotangents take the structure and dtypes of the inputs: a
    # skeleton of them, not the values (which would become residuals).
    likes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), invals)
    fun = jax.custom_vjp(primal)

    def fwd(*xs):
        _, vjp_fn = jax.vjp(original, *to_original(xs))
        return primal(*xs), vjp_fn

    def bwd(vjp_fn, cts):
        in_cts = vjp_fn([interp.to_original(c, a) for c, a in zip(cts, out_avals)])
        return tuple(interp.from_original(c, x) for c, x in zip(in_cts, likes))

    fun.defvjp(fwd, bwd)
    return list(fun(*invals))


#: The default handler table: primitive name -> handler.
HANDLERS: Mapping[str, Handler] = {
    "jit": _call,
    "closed_call": _call,  # a legacy name (compat.LEGACY_PRIMITIVES)
    "remat2": _checkpoint,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
}


# --- Evaluating higher-order primitives on concrete values --------------------------------

#: How many equations a loop evaluated one iteration at a time may run (length times the
#: body's equations) before it is traced and compiled as a loop instead.
EAGER_LOOP_BUDGET = 20_000


def _is_concrete(values) -> bool:
    return not any(compat.is_tracer(x) for x in jax.tree_util.tree_leaves(values))


def _eager_cond(interp: Interpreter, eqn, invals):
    branches = compat.cond_branches(eqn)
    index = int(interp.to_original(invals[0], eqn.invars[0].aval))
    return interp.eval_closed(branches[min(max(index, 0), len(branches) - 1)], invals[1:])


def _eager_scan(interp: Interpreter, eqn, invals):
    p = compat.scan(eqn)
    if not p.length or p.length * len(p.body.jaxpr.eqns) > EAGER_LOOP_BUDGET:
        return None
    nc, ncarry = p.num_consts, p.num_carry
    consts, carry, xs = invals[:nc], invals[nc:nc + ncarry], invals[nc + ncarry:]
    steps = range(p.length)
    ys = []
    for i in (reversed(steps) if p.reverse else steps):
        x = [jax.tree_util.tree_map(lambda v, i=i: v[i], x) for x in xs]
        outs = interp.eval_closed(p.body, [*consts, *carry, *x])
        carry = outs[:ncarry]
        ys.append(outs[ncarry:])
    if p.reverse:
        ys.reverse()
    stacked = [jax.tree_util.tree_map(lambda *vs: jnp.stack(vs), *per_step) for per_step in zip(*ys)]
    return [*carry, *stacked]


def _eager_while(interp: Interpreter, eqn, invals):
    p = compat.while_loop(eqn)
    cn, bn = p.cond_nconsts, p.body_nconsts
    cconsts, bconsts, carry = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
    cost = len(p.cond.jaxpr.eqns) + len(p.body.jaxpr.eqns) + 1
    for _ in range(EAGER_LOOP_BUDGET // cost):
        (pred,) = interp.eval_closed(p.cond, [*cconsts, *carry])
        if not bool(interp.to_original(pred, p.cond.out_avals[0])):
            return carry
        carry = interp.eval_closed(p.body, [*bconsts, *carry])
    return _while(interp, eqn, [*cconsts, *bconsts, *carry])  # the rest of a long loop, traced


# ``checkpoint`` and custom derivative rules: on concrete values, only the primal matters.
_EAGER = {"remat2": _call,
          "custom_jvp_call": _call, "custom_vjp_call": _call,
          "cond": _eager_cond, "scan": _eager_scan, "while": _eager_while}


def _eager_or_traced(name: str, traced: Handler) -> Handler:
    def handler(interp: Interpreter, eqn, invals):
        if _is_concrete(invals):
            outs = _EAGER[name](interp, eqn, invals)
            if outs is not None:
                return list(outs)
        return traced(interp, eqn, invals)

    return handler


def eager_handlers(handlers: Mapping[str, Handler] = HANDLERS) -> dict[str, Handler]:
    """``handlers`` for an interpreter that only evaluates (it is not differentiated or traced
    afterwards): on concrete values, a ``checkpoint`` or a custom derivative rule runs its
    primal inline, a ``cond`` its chosen branch, and a loop one iteration at a time (up to
    :data:`EAGER_LOOP_BUDGET` equations, then as a loop), with nothing compiled but each
    operation. Inside traced code they are the ``handlers`` given."""
    return {**handlers, **{name: _eager_or_traced(name, handlers[name])
                           for name in _EAGER if name in handlers}}


def transform(fn: Callable, run: Callable[[Any, list], list]) -> Callable:
    """``fn`` traced to a jaxpr at each call and evaluated by ``run`` instead.

    The array leaves of the arguments (traced or concrete) become the jaxpr's
    inputs; every other leaf is closed over. ``run(closed, arrays)`` receives
    the ``ClosedJaxpr`` and those arrays and returns the output arrays, which
    are put back into ``fn``'s output structure.
    """

    def transformed(*args, **kwargs):
        flat_fn, arrays = jaxprs.over_arrays(fn, args, kwargs)
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(arrays)
        outs = run(closed, jax.tree_util.tree_leaves(arrays))
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return transformed
