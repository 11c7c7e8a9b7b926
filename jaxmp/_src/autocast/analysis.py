"""What autocast reads from the traced program before it evaluates it: three dataflow analyses.

Each walks the jaxpr of ``fn`` (sub-jaxprs included) once, from the rules
(``rules.py``) alone, and returns a set of variables that the interpreter
(``interpreter.py``) consults equation by equation:

* ``narrow_safe``: the values that must stay wide. A normalised value (a
  softmax, a layer norm) is narrowed to the compute dtype once computed,
  unless something downstream needs its float32 digits: a ``full_precision``
  operation, a loop, a branch or an output of the function;
* ``narrow_early``: the collectives whose result feeds only matrix products,
  so they can move their operand already narrowed (half the bytes: FSDP's
  gathers);
* ``shifted_exps``: the exponentials of a softmax, ``exp(x - max(x))``, which
  lie in ``[0, 1]`` and can run in half precision when the probabilities go
  on in half precision;
* ``broadcast_sizes``: the values that are a smaller value broadcast (a
  normalisation's per-feature scale), with that value's size, so that the
  interpreter tells a statistic scaled per feature from a normalised activation.

Nothing here changes the program; ``autocast`` (``__init__.py``) runs these
and hands their results to the interpreter.
"""

from __future__ import annotations

from jaxmp._src import compat
from jaxmp._src import jaxprs
from jaxmp._src.autocast import rules as rules_lib

# Reductions: their results are statistics of a tensor (see ``interpreter.Autocast``).
_REDUCTIONS = compat.REDUCTIONS
# Sums: linear, accumulated in float32 (see ``narrow_safe``).
_SUMS = compat.LINEAR_REDUCTIONS


def narrow_safe(closed, rules: rules_lib.AutocastRules) -> frozenset:
    """The variables of ``closed`` (sub-jaxprs included) whose value must stay wide.

    A normalised value (see ``interpreter.Autocast``) is narrowed to the compute dtype
    only where nothing downstream needs its float32 digits: a value is in
    the returned set when it reaches, through ``follow`` and ``passthrough``
    operations, casts and sums, a ``full_precision`` operation (``log`` of a
    probability, a square), a loop or a branch, or an output of the function.
    A sum (``reduce_sum``) passes the need on, as a ``follow`` operation does:
    it accumulates in float32 whatever it reads, so the average pooling after a
    network's last normalisation reads that in the compute dtype, as a
    hand-written half-precision network does.
    """
    needed: set = set()

    def walk(jaxpr, out_needed):
        local = {v for v, n in zip(jaxpr.outvars, out_needed)
                 if n and not compat.is_literal(v)}
        for eqn in reversed(jaxpr.eqns):
            name = eqn.primitive.name
            outs_needed = [v in local for v in eqn.outvars]
            inner = compat.called_jaxpr(eqn, None)
            if name in compat.LOOPS_AND_BRANCHES:
                for sub, _ in jaxprs.sub_jaxprs(eqn):
                    walk(sub, [True] * len(sub.outvars))
                ins = [True] * len(eqn.invars)
            elif inner is not None and hasattr(getattr(inner, "jaxpr", inner), "eqns"):
                inner = getattr(inner, "jaxpr", inner)
                ins = walk(inner, outs_needed)
            elif name in _SUMS and rules.kind(name) == "full_precision":
                # Accumulated in float32 whatever its operand's dtype, as a product
                # accumulates its half-precision operands: those need their float32
                # digits only where the sum does (a probability summed on its way to a
                # log, a sum the function returns), not where it is pooled and goes on.
                ins = [any(outs_needed)] * len(eqn.invars)
            elif rules.kind(name) == "full_precision":
                ins = [True] * len(eqn.invars)
            elif rules.kind(name) in ("low_precision", "bounded"):
                ins = [False] * len(eqn.invars)  # they narrow their operands anyway
            elif (rules.kind(name) in ("follow", "passthrough")
                  or name == "convert_element_type"):
                ins = [any(outs_needed)] * len(eqn.invars)
            else:
                ins = [True] * len(eqn.invars)  # run as written, in float32
            for v, n in zip(eqn.invars, ins):
                if n and not compat.is_literal(v):
                    local.add(v)
        needed.update(local)
        return [v in local for v in jaxpr.invars]

    walk(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    return frozenset(needed)


# Collectives that move a value between devices unchanged (no arithmetic).
_MOVING = compat.MOVING_COLLECTIVES
# Operations that move a value's elements around on one device, no arithmetic.
_MOVEMENT = compat.MOVEMENT


def narrow_early(closed, rules: rules_lib.AutocastRules) -> frozenset:
    """The results of moving collectives that can move in the compute dtype.

    An ``all_gather``, ``ppermute`` or ``all_to_all`` whose result reaches,
    through data movement only (``_MOVEMENT``), nothing but ``low_precision``
    operations (the matrix products, which narrow their operands to the
    compute dtype anyway) can move its operand already narrowed: the same
    values, half the bytes. This is what FSDP needs: a float32 parameter
    shard that the loss all-gathers for a product is gathered in the compute
    dtype, as the cast path gathers it, and the gradient's reduce-scatter
    (the gather's transpose) then runs in the compute dtype too. A result
    that reaches anything else (a float32 region, an output, a loop) is
    moved as it is. Returned as the collectives' output variables (sub-jaxprs
    included).
    """
    found: set = set()

    def walk(jaxpr):
        uses = jaxprs.Uses(jaxpr)
        users, outputs = uses.users, uses.outputs
        memo: dict = {}

        def only_narrowed(v) -> bool:
            if v not in memo:
                uses = users.get(v, [])
                memo[v] = bool(uses) and v not in outputs and all(
                    rules.kind(e.primitive.name) == "low_precision"
                    or (e.primitive.name in _MOVEMENT and all(map(only_narrowed, e.outvars)))
                    for e in uses)
            return memo[v]

        for e in jaxpr.eqns:
            if e.primitive.name in _MOVING and all(map(only_narrowed, e.outvars)):
                found.update(e.outvars)
            for inner, _ in jaxprs.sub_jaxprs(e):
                walk(inner)

    walk(closed.jaxpr)
    return frozenset(found)


# Operations that pass a value on unchanged but for its shape (or its rounding).
_RESHAPING = compat.RESHAPING


def shifted_exps(closed, keep: frozenset) -> frozenset:
    """The ``exp`` equations of ``closed`` (sub-jaxprs included) that can run in half precision.

    That is ``exp(a - m)`` where ``m`` is at least the maximum of ``a`` along
    some axes (``reduce_max`` of ``a``, broadcast, reshaped, behind a
    ``stop_gradient``, a ``max`` with anything, or chosen by a ``select`` on
    its own finiteness against a literal, as ``logsumexp`` does): the
    exponentials of a softmax, a log-softmax or a ``logsumexp``, which lie
    in ``[0, 1]``. Of those, the ones returned are a softmax's whose
    probabilities go on in half precision: an ``exp`` each of whose users is a sum
    (run in float32) or has results that ``keep`` (from ``narrow_safe``)
    does not hold, and at least one is not a sum. So the exponentials of a
    log-softmax or ``logsumexp`` (only summed, on their way to a ``log``)
    stay float32: their derivative, ``p - onehot`` for a cross-entropy,
    cancels where a probability approaches 1, and half-precision
    probabilities would double its rounding error. So do those of a
    probability that reaches a ``log`` or an output of the function (their
    tiny values matter there). Returned as the equations' output variables.
    """
    found: set = set()

    def walk(jaxpr):
        uses = jaxprs.Uses(jaxpr)
        producer, users, outputs = uses.producer, uses.users, uses.outputs

        def strip(v):
            while not compat.is_literal(v) and v in producer:
                e = producer[v]
                if e.primitive.name not in _RESHAPING:
                    break
                v = e.invars[0]
            return v

        def at_least_max_of(m, a, depth=0) -> bool:
            m = strip(m)
            e = None if compat.is_literal(m) else producer.get(m)
            if e is None or depth > 8:
                return False
            name = e.primitive.name
            if name == "reduce_max":
                return strip(e.invars[0]) == a
            if name == "max":
                return any(at_least_max_of(x, a, depth + 1) for x in e.invars)
            if name == "select_n":
                pred, *cases = e.invars
                p = None if compat.is_literal(pred) else producer.get(strip(pred))
                literal = [compat.is_literal(strip(c)) for c in cases]
                return (p is not None and p.primitive.name == "is_finite"
                        and at_least_max_of(p.invars[0], a, depth + 1)
                        and any(literal)
                        and all(at_least_max_of(c, a, depth + 1)
                                for c, lit in zip(cases, literal) if not lit))
            return False

        for e in jaxpr.eqns:
            for inner, _ in jaxprs.sub_jaxprs(e):
                walk(inner)
            if e.primitive.name != "exp" or compat.is_literal(e.invars[0]):
                continue
            out = e.outvars[0]
            others = [u for u in users.get(out, ()) if u.primitive.name not in _REDUCTIONS]
            if (out in outputs or not others
                    or any(o in keep for u in others for o in u.outvars)):
                continue
            d = producer.get(e.invars[0])
            if d is not None and d.primitive.name == "sub":
                a, m = d.invars
                if not compat.is_literal(a) and at_least_max_of(m, strip(a)):
                    found.add(e.outvars[0])

    walk(closed.jaxpr)
    return frozenset(found)


def broadcast_sizes(closed) -> dict:
    """The variables of ``closed`` (sub-jaxprs included) that broadcast a smaller value, with
    its size.

    A value made from a smaller one by ``_RESHAPING`` operations only (a per-feature scale
    or a statistic broadcast to an activation's shape, ``jnp.broadcast_to``) holds no more
    numbers than that one: the interpreter compares these sizes, not the broadcast shapes,
    to tell a statistic scaled per feature (``scale * rsqrt(var + eps)``, a statistic
    still) from a normalised activation (``(x - mean) * rsqrt(var + eps)``).
    """
    found: dict = {}

    def walk(jaxpr):
        for e in jaxpr.eqns:
            for inner, _ in jaxprs.sub_jaxprs(e):
                walk(inner)
            if (e.primitive.name in _RESHAPING and len(e.outvars) == 1 and e.invars
                    and not compat.is_literal(e.invars[0])):
                source = e.invars[0]
                size = found.get(source, source.aval.size)
                if size < e.outvars[0].aval.size:
                    found[e.outvars[0]] = size

    walk(closed.jaxpr)
    return found
