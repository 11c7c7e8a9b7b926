"""Reading traced programs: the one place jaxmp walks, indexes and traces jaxprs.

Every tool that reads a jaxpr (the census and its warnings, the precision
report, the non-finite search, autocast, the float8 products) uses these
rather than writing its own:

* walking: :func:`walk` (every equation, nested ones included, with how often
  it runs and what encloses it), :func:`sub_jaxprs` and :func:`loop_trips`
  (which read equation parameters, so they live in :mod:`jaxmp._src.compat`
  and are re-exported here), :func:`called_jaxpr`;
* the use/def index: :class:`Uses` (which equation defines each variable,
  which read it, what the jaxpr returns), :func:`nested_producers` and
  :func:`call_aliases`, and :func:`wide_origins` (where a float32 value got
  its width, followed back through them);
* what a product computes: :func:`eqn_flops` (``2 *`` multiply-adds of a
  ``dot_general`` or ``conv_general_dilated``), :func:`dot_layout` and
  :func:`dot_transposes` (the two backward products of a ``dot_general``);
* the leaf partition: :func:`over_arrays` (a function of the array leaves of
  its arguments, the rest closed over: what is traced, lowered or
  differentiated), :func:`at_positions` (the leaves of some arguments
  only, and how to put them back) and :func:`shape_dtype` (a leaf's shape and
  dtype as ``jit`` traces it).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from jax import lax

from jaxmp._src import casting
from jaxmp._src import compat

PyTree = Any

# --- Walking ------------------------------------------------------------------------------------

#: The (open) jaxprs inside an equation (scan, while, cond, jit, checkpoint, custom rules,
#: shard_map), each with how many times it runs per run of the equation.
sub_jaxprs = compat.sub_jaxprs
#: How often a ``while`` equation runs its body, when it counts its iterations, else 1.
loop_trips = compat.loop_trips


def called_jaxpr(eqn):
    """The (open) jaxpr that ``eqn`` calls on exactly its operands, or ``None``.

    Such an equation (``jit``, ``closed_call``, ``checkpoint``, a custom rule)
    has one input per operand and one output per result, in order.
    """
    if eqn.primitive.name not in compat.CALLS:
        return None
    inner = compat.open_jaxpr(compat.called_jaxpr(eqn, None))
    if inner is None or len(inner.invars) != len(eqn.invars) or (
            len(inner.outvars) != len(eqn.outvars)):
        return None
    return inner


def walk(jaxpr, repeat: int = 1, enclosing: tuple = ()) -> Iterator[tuple[Any, int, tuple]]:
    """``(eqn, times it runs, enclosing equations)`` for every equation of ``jaxpr``, nested ones
    included (each before those inside it).

    A loop body runs the loop's trip count times per run of the loop
    (:func:`sub_jaxprs`); ``repeat`` and ``enclosing`` are those of ``jaxpr``
    itself.
    """
    for eqn in jaxpr.eqns:
        yield eqn, repeat, enclosing
        for inner, times in sub_jaxprs(eqn):
            yield from walk(inner, repeat * times, enclosing + (eqn,))


# --- The use/def index --------------------------------------------------------------------------


class Uses:
    """Which equation defines each variable of a jaxpr, which equations read it, what it returns.

    Only the jaxprs added are indexed, not those nested in their equations;
    literals are skipped. Built on one jaxpr (``Uses(jaxpr)``), or on several
    one after another (:meth:`add`: a variable read in two of them lists the
    readers of the first, then of the second).

    Attributes:
        producer: variable -> the equation that defines it (with
            ``positions=True``, its index in the jaxpr's equations).
        users: variable -> the equations that read it, in order, once per
            operand that reads it (with ``positions=True``, their indices).
        outputs: the variables the jaxprs return.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> jaxpr = jax.make_jaxpr(lambda x: jnp.sin(x) * x)(1.0).jaxpr
        >>> uses = Uses(jaxpr)
        >>> [e.primitive.name for e in uses.users[jaxpr.invars[0]]]
        ['sin', 'mul']
        >>> uses.producer[jaxpr.outvars[0]].primitive.name, jaxpr.outvars[0] in uses.outputs
        ('mul', True)
        >>> Uses(jaxpr, positions=True).users[jaxpr.invars[0]]
        [0, 1]
    """

    def __init__(self, jaxpr=None, *, positions: bool = False):
        self.positions = positions
        self.producer: dict = {}
        self.users: dict = {}
        self.outputs: set = set()
        if jaxpr is not None:
            self.add(jaxpr)

    def add(self, jaxpr) -> None:
        """Indexes the equations and outputs of ``jaxpr`` (open) too."""
        for i, eqn in enumerate(jaxpr.eqns):
            found = i if self.positions else eqn
            for v in eqn.outvars:
                self.producer[v] = found
            for v in eqn.invars:
                if not compat.is_literal(v):
                    self.users.setdefault(v, []).append(found)
        self.outputs.update(v for v in jaxpr.outvars if not compat.is_literal(v))


def nested_producers(jaxpr) -> dict:
    """``{variable: (eqn, enclosing equations)}`` for the results of every equation of
    ``jaxpr``, nested ones included (:func:`walk`; a jaxpr walked twice keeps its last)."""
    return {v: (eqn, enclosing) for eqn, _, enclosing in walk(jaxpr) for v in eqn.outvars}


def call_aliases(jaxpr) -> dict:
    """``{variable: the variable it stands for}`` across the calls of ``jaxpr`` (nested ones
    included, :func:`called_jaxpr`): each input of a called jaxpr stands for its equation's
    operand, each result of the equation for the called jaxpr's result."""
    same: dict = {}
    for eqn, _, _ in walk(jaxpr):
        called = called_jaxpr(eqn)
        if called is not None:
            same.update(zip(called.invars, eqn.invars))
            same.update(zip(eqn.outvars, called.outvars))
    return same


#: Operations that pass a value on without computing new numbers from it: a parameter that
#: only these reach a product through is still read from the function's inputs.
_PASSING = compat.MOVEMENT | compat.RESHAPING | frozenset({"concatenate"})


def read_from_inputs(jaxpr) -> dict:
    """``{id(product eqn): (lhs, rhs)}``: whether each operand of every ``dot_general`` and
    ``conv_general_dilated`` of ``jaxpr`` (nested ones included) is read from its inputs.

    An operand is read from the inputs when it is an input (or constant) of
    ``jaxpr``, followed only through operations that move, reshape, convert or
    concatenate values (:data:`_PASSING`) and across nested calls, branches
    and a ``scan``'s constants and sliced inputs (stacked weights): a
    parameter, a batch, a cache the function is given. Anything else (the
    result of a product, a softmax, a sum, a loop's carry) is an activation
    the function computes.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> def f(w, x):
        ...     h = x @ w.astype(jnp.bfloat16).T             # w read from the inputs
        ...     return jnp.einsum("bij,bkj->bik", h, h * 2)  # two activations
        >>> jaxpr = jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((2, 3, 4), jnp.bfloat16)).jaxpr
        >>> sorted(read_from_inputs(jaxpr).values())
        [(False, False), (True, True)]
    """
    found: dict = {}

    def visit(inner, given) -> set:
        plain = {v for v, p in zip(inner.invars, given) if p}
        plain.update(getattr(inner, "constvars", ()))
        is_plain = lambda v: not compat.is_literal(v) and v in plain
        for eqn in inner.eqns:
            name = eqn.primitive.name
            if name in compat.PRODUCTS:
                found[id(eqn)] = (is_plain(eqn.invars[0]), is_plain(eqn.invars[1]))
            if name in _PASSING:
                floats = [v for v in eqn.invars if not compat.is_literal(v)]
                if floats and all(v in plain for v in floats[:1 if name != "concatenate"
                                                              else None]):
                    plain.update(eqn.outvars)
                continue
            for body, _ in sub_jaxprs(eqn):
                ins = [is_plain(v) for v in eqn.invars]
                if name == "scan":
                    try:
                        scan = compat.scan(eqn)
                        first, n = scan.num_consts, scan.num_carry
                        ins[first:first + n] = [False] * n  # a carry changes each iteration
                    except compat.UnknownEquation:
                        ins = []
                elif name == "cond":
                    ins = ins[1:]
                if len(ins) != len(body.invars) or name == "while":
                    ins = [False] * len(body.invars)
                out = visit(body, ins)
                if name in compat.CALLS and len(body.outvars) == len(eqn.outvars):
                    plain.update(o for o, b in zip(eqn.outvars, body.outvars)
                                 if not compat.is_literal(b) and b in out)
        return plain

    visit(jaxpr, [True] * len(jaxpr.invars))
    return found


def _width(v) -> int:
    """The bytes of ``v``'s floating-point dtype (0 for any other)."""
    dtype = v.aval.dtype
    return np.dtype(dtype).itemsize if casting.is_float_dtype(dtype) else 0


def wide_origins(values: Sequence[Any], producer: dict, same: dict | None = None,
                 skip: Callable[[Any, tuple], bool] | None = None,
                 limit: int = 512) -> Iterator[tuple[Any, Any]]:
    """Where the floating-point ``values`` got their width, followed back through the program.

    A result as wide as a floating-point operand of its equation (a float32
    ``add``, ``concatenate``, ``reshape``, ``broadcast_in_dim``, ``gather``...)
    inherits the width from those operands, which are followed in turn,
    across calls (``same``). The value where it stops made the width: the
    result of an equation with no such operand (``jnp.zeros``' broadcast of a
    float32 literal, a widening ``convert_element_type``), of a matrix product
    or convolution (the layer that computed it), of a loop or branch, or an
    input of the program.

    Args:
        values: the variables to start from, in the order to follow them
            (those ``skip`` skips last).
        producer: ``{variable: (eqn, enclosing)}`` (:func:`nested_producers`).
        same: ``{variable: the variable it stands for}`` (:func:`call_aliases`).
        skip: ``skip(eqn, enclosing)`` for equations that are no origin of
            their own (those jaxmp added, the backward pass): their
            floating-point operands are followed whatever their width, and
            one with none yields nothing; their results are followed after
            the other operands of the equation that reads them.
        limit: how many variables to visit at most.

    Yields:
        ``(variable, (eqn, enclosing))`` for a value an equation made wide, or
        ``(variable, None)`` for an input of the program (or of a nested
        jaxpr whose inputs are not its equation's operands), depth first: the
        first operand's origins before the second's.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> def f(x):  # x is bfloat16: the float32 comes from the zeros
        ...     z = jnp.zeros((2, 3))
        ...     return jnp.concatenate([x.astype(jnp.float32), z]).reshape(3, 4)
        >>> jaxpr = jax.make_jaxpr(f)(jnp.ones((2, 3), jnp.bfloat16)).jaxpr
        >>> found = wide_origins(jaxpr.outvars, nested_producers(jaxpr))
        >>> [eqn.primitive.name for _, (eqn, _) in found]
        ['convert_element_type', 'broadcast_in_dim']
    """
    same = same or {}
    skipped: dict = {}  # id(eqn) -> skip(eqn, enclosing)

    def resolve(v):  # a value a call returns is the called jaxpr's, and so on
        for _ in range(64):
            if compat.is_literal(v) or v not in same:
                break
            v = same[v]
        return v

    def skips(v) -> bool:
        found = None if skip is None or compat.is_literal(v) else producer.get(v)
        if found is not None and id(found[0]) not in skipped:
            skipped[id(found[0])] = skip(*found)
        return found is not None and skipped[id(found[0])]

    def push(found: list) -> None:  # to visit in order, those skipped last
        found = [resolve(u) for u in found]
        stack.extend(reversed([u for u in found if not skips(u)] + [u for u in found if skips(u)]))

    stack: list = []
    seen: set = set()
    push(list(values))
    while stack and len(seen) < limit:
        v = stack.pop()
        if compat.is_literal(v) or v in seen:
            continue
        seen.add(v)
        found = producer.get(v)
        if found is None:
            yield v, None
            continue
        eqn = found[0]
        # A product's result is its own (the layer that made it is named, not its inputs), and
        # so is a loop's or a branch's.
        own = eqn.primitive.name not in compat.PRODUCTS and not any(True for _ in sub_jaxprs(eqn))
        floats = [u for u in eqn.invars if not compat.is_literal(u) and _width(u)] if own else []
        if not skips(v):
            floats = [u for u in floats if _width(u) >= _width(v)]
            if not floats:
                yield v, found
        push(floats)


# --- Products -----------------------------------------------------------------------------------


def conv_macs(out: Sequence[int], kernel: Sequence[int], out_features: int,
              lhs_dilation: Sequence[int] = ()) -> int:
    """Multiply-adds of one run of a convolution with result shape ``out`` and ``kernel``.

    Each output element takes ``prod(kernel) / out_features`` multiply-adds
    (zero padding included), except for the zeros of an input dilated by
    ``lhs_dilation`` (the input gradient of a strided convolution, a transposed
    convolution): those multiply nothing, and XLA runs such a product as the
    strided convolution's backward pass (cuDNN's backward-data convolution),
    which skips them. It counts ``1 / prod(lhs_dilation)`` of the dilated
    count: exactly the forward convolution's multiply-adds when the input size
    is the output size times the stride (``"SAME"`` padding), as
    :func:`jaxmp.debug.gpu_program` counts the product it runs.
    """
    return (math.prod(out) * math.prod(kernel) // max(out_features, 1)
            // max(math.prod(lhs_dilation), 1))


def eqn_flops(eqn) -> int:
    """``2 *`` multiply-adds of one run of a ``dot_general`` or ``conv_general_dilated``
    equation, as :func:`jaxmp.debug.matmul_flops` counts them.

    A convolution's output element takes ``prod(kernel) / out_features``
    multiply-adds, less the zeros of a dilated input
    (:func:`conv_macs`).
    """
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    out = eqn.outvars[0].aval
    if eqn.primitive.name == "dot_general":
        (contracting, _), _ = compat.dimension_numbers(eqn)
        return 2 * math.prod(out.shape) * math.prod(lhs.shape[i] for i in contracting)
    out_features = rhs.shape[compat.dimension_numbers(eqn).rhs_spec[0]]
    dilation = compat.conv_params(eqn).get("lhs_dilation") or ()
    return 2 * conv_macs(out.shape, rhs.shape, out_features, dilation)


def dot_layout(a_ndim: int, b_ndim: int, dimension_numbers) -> tuple[list, list, list, list, list]:
    """``(a_free, b_free, ct_batch, ct_a, ct_b)`` of ``dot_general(a, b)``: the free dimensions
    of each operand, and where the product (and its cotangent) holds the batch dimensions,
    ``a``'s free ones and ``b``'s."""
    (ac, bc), (ab, bb) = dimension_numbers
    a_free = [d for d in range(a_ndim) if d not in ac and d not in ab]
    b_free = [d for d in range(b_ndim) if d not in bc and d not in bb]
    nb = len(ab)
    return (a_free, b_free, list(range(nb)), list(range(nb, nb + len(a_free))),
            list(range(nb + len(a_free), nb + len(a_free) + len(b_free))))


def dot_transposes(ct, a, b, dimension_numbers, product: Callable, *,
                   ct_first: bool = False) -> tuple[Any, Any]:
    """The two backward products of ``dot_general(a, b)`` for the cotangent ``ct``.

    ``ct`` has the layout of the product: batch dimensions, then ``a``'s free
    dimensions, then ``b``'s. ``product(x, y, dimension_numbers)`` computes
    each (a ``dot_general`` in the dtype and precision the caller wants);
    each is then transposed into the layout of the argument it
    differentiates. ``b``'s gradient multiplies ``a`` by ``ct`` (``a`` on the
    left keeps ``b``'s free dimensions last, as in the forward product), or
    ``ct`` by ``a`` with ``ct_first`` (JAX's own rule).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> a, b, ct = jnp.ones((2, 3)), jnp.ones((3, 4)), jnp.ones((2, 4))
        >>> dims = (((1,), (0,)), ((), ()))
        >>> da, db = dot_transposes(ct, a, b, dims, jax.lax.dot_general)
        >>> da.shape, db.shape
        ((2, 3), (3, 4))
    """
    (ac, bc), (ab, bb) = dimension_numbers
    a_free, b_free, ct_batch, ct_a, ct_b = dot_layout(a.ndim, b.ndim, dimension_numbers)
    # d/da: contract ct's b-free dimensions with b's free dimensions. The result
    # has a's batch, then a's free dimensions, then b's contracting ones in b's
    # order, each standing for the contracting dimension of a it pairs with.
    da = product(ct, b, ((ct_b, b_free), (ct_batch, list(bb))))
    da_dims = list(ab) + a_free + [ac[i] for i in np.argsort(bc)]
    da = lax.transpose(da, tuple(int(i) for i in np.argsort(da_dims)))
    # d/db: the same with the roles exchanged.
    if ct_first:
        db = product(ct, a, ((ct_a, a_free), (ct_batch, list(ab))))
        db_dims = list(bb) + b_free + [bc[i] for i in np.argsort(ac)]
    else:
        db = product(a, ct, ((a_free, ct_a), (list(ab), ct_batch)))
        db_dims = list(bb) + [bc[i] for i in np.argsort(ac)] + b_free
    db = lax.transpose(db, tuple(int(i) for i in np.argsort(db_dims)))
    return da, db


# --- The leaf partition -------------------------------------------------------------------------


def over_arrays(fn: Callable, args: Sequence[Any], kwargs: dict,
                is_dynamic: Callable[[Any], bool] = casting.is_array) -> tuple[Callable, PyTree]:
    """``fn`` as a function of the array leaves of its arguments, to trace, lower or evaluate.

    Args:
        fn: any function.
        args: its positional arguments.
        kwargs: its keyword arguments.
        is_dynamic: which leaves of ``(args, kwargs)`` become inputs (default:
            the arrays); every other leaf (a function, a static field,
            ``None``) is closed over.

    Returns:
        ``(call, dynamic)``: ``dynamic`` is ``(args, kwargs)`` with ``None``
        in place of the leaves closed over, and ``call(dynamic)`` runs ``fn``
        on the arguments with their dynamic leaves taken from ``dynamic`` and
        returns what it returns.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> call, dynamic = over_arrays(lambda x, n, scale: x * n * scale, (jnp.ones(2), 3),
        ...                             {"scale": jnp.float32(2)})
        >>> dynamic
        ((Array([1., 1.], dtype=float32), None), {'scale': Array(2., dtype=float32)})
        >>> len(jax.make_jaxpr(call)(dynamic).jaxpr.invars)
        2
    """
    dynamic, static = casting.partition((args, kwargs), is_dynamic)

    def call(dynamic):
        call_args, call_kwargs = casting.combine(dynamic, static)
        return fn(*call_args, **call_kwargs)

    return call, dynamic


def at_positions(args: Sequence[Any], positions: Sequence[int],
                 is_chosen: Callable[[Any], bool] | None = None) -> tuple[tuple, Callable]:
    """The chosen leaves of the arguments at ``positions``, and how to put them back.

    Args:
        args: positional arguments.
        positions: the indices of those to split (the differentiated ones).
        is_chosen: which of their leaves are chosen (default:
            :func:`casting.is_float_array`, the leaves that are differentiated).

    Returns:
        ``(chosen, rebuild)``: ``chosen`` holds one tree per position, with
        ``None`` in place of the leaves not chosen; ``rebuild(new_chosen)``
        returns the full argument list with the chosen leaves replaced.
    """
    parts = [casting.partition(args[i], is_chosen) for i in positions]

    def rebuild(new_chosen):
        full = list(args)
        for i, chosen, (_, rest) in zip(positions, new_chosen, parts):
            full[i] = casting.combine(chosen, rest)
        return full

    return tuple(chosen for chosen, _ in parts), rebuild


def is_dynamic(x: Any) -> bool:
    """Whether the argument leaf ``x`` is traced (an array or a ``jax.ShapeDtypeStruct``) by the
    measures of :mod:`jaxmp.debug` (:func:`jaxmp.debug.gpu_program` too); any other leaf is
    closed over."""
    return casting.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def shape_dtype(x: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
    """The shape and dtype of the array leaf ``x`` as ``jax.jit`` traces it.

    ``jax.jit`` traces a NumPy ``int64`` (``float64``) leaf, such as the
    ``np.arange`` indices of a graph batch, as ``int32`` (``float32``) unless
    x64 is enabled, silently; ``jax.ShapeDtypeStruct(x.shape, x.dtype)`` would
    ask for ``int64`` and JAX would warn that it truncates. Every tool that
    stands a leaf's shape and dtype in for it uses this, and says what ``jit``
    says: nothing.

    Args:
        x: an array (JAX or NumPy) or a ``jax.ShapeDtypeStruct``.
        sharding: the sharding to give it (default: none).

    Examples:
        >>> import numpy as np
        >>> shape_dtype(np.arange(3)).dtype  # without jax_enable_x64
        dtype('int32')
    """
    dtype = x.dtype
    if not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):  # typed PRNG keys stay
        dtype = jax.dtypes.canonicalize_dtype(dtype)
    return jax.ShapeDtypeStruct(x.shape, dtype, sharding=sharding)


def array_leaves(tree: PyTree) -> list:
    """The array leaves of ``tree``: what a traced function may return.

    A step's outputs may hold what is not a JAX type (an Equinox module
    returned updated holds its activation function, a ``jax.custom_jvp``;
    static fields; strings): the measures need only the arrays.
    """
    return [x for x in jax.tree_util.tree_leaves(tree) if casting.is_array(x)]


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
    return over_arrays(lambda *a, **k: array_leaves(fn(*a, **k)), args, kwargs, is_dynamic)
