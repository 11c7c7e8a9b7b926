"""Reading jaxprs (jaxmp/_src/jaxprs.py): the walk, the use/def index, the FLOPs of a product,
the dot_general transposes and the leaf partition that every tool uses."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from jaxmp._src import census
from jaxmp._src import compat
from jaxmp._src import float8
from jaxmp._src import jaxprs
from tests import helpers

W, X = jnp.ones((8, 8)), jnp.ones((4, 8))
ONE = 2 * 4 * 8 * 8  # the FLOPs of one X @ W


def _jaxpr(fn, *args):
    return jax.make_jaxpr(fn)(*args).jaxpr


def _products(fn, *args):
    """``(times it runs, names of the enclosing equations)`` of each dot_general of ``fn``."""
    return [(times, tuple(e.primitive.name for e in enclosing))
            for eqn, times, enclosing in jaxprs.walk(_jaxpr(fn, *args))
            if eqn.primitive.name == "dot_general"]


def _loop_in_loop(w, x):
    # A product in a scan of 5 in a fori_loop of 3 (fixed bounds: also a scan).
    def outer(i, h):
        return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), h, None, length=5)[0]

    return jnp.sum(jax.lax.fori_loop(0, 3, outer, x))


def test_walk_counts_each_equation_as_often_as_it_runs():
    scanned = lambda w, x: jax.lax.scan(lambda h, _: (h @ w, None), x, None, length=5)[0]
    assert _products(scanned, W, X) == [(5, ("scan",))]
    assert _products(_loop_in_loop, W, X) == [(15, ("scan", "scan"))]
    fori = lambda w, x, n: jax.lax.fori_loop(0, n, lambda i, h: h @ w, x)
    assert _products(fori, W, X, 3) == [(1, ("while",))]  # traced bounds: not counted
    counted = lambda w, x: jax.lax.while_loop(lambda c: c[0] < 4,
                                              lambda c: (c[0] + 1, c[1] @ w), (0, x))[1]
    assert _products(counted, W, X) == [(4, ("while",))]
    nested = lambda w, x: jax.jit(lambda x: jax.jit(lambda x: x @ w)(x) @ w)(x)
    assert _products(nested, W, X) == [(1, ("jit", "jit")), (1, ("jit",))]
    branches = lambda w, x: jax.lax.cond(x[0, 0] > 0, lambda x: x @ w, lambda x: x @ w.T, x)
    assert _products(branches, W, X) == [(1, ("cond",)), (1, ("cond",))]
    # Each equation comes before those inside it, with ``repeat`` and ``enclosing`` given.
    jaxpr = _jaxpr(scanned, W, X)
    walked = list(jaxprs.walk(jaxpr, repeat=2, enclosing=("outer",)))
    assert walked[0] == (jaxpr.eqns[0], 2, ("outer",))
    assert walked[1][1:] == (10, ("outer", jaxpr.eqns[0]))


def test_walk_enters_custom_derivative_rules():
    @jax.custom_vjp
    def f(w, x):
        return x @ w

    f.defvjp(lambda w, x: (x @ w, (w, x)), lambda res, g: (res[1].T @ g, g @ res[0].T))
    assert _products(f, W, X) == [(1, ("custom_vjp_call",))]
    assert len(_products(jax.grad(lambda w, x: jnp.sum(f(w, x))), W, X)) == 3  # fwd, then bwd


def test_loop_trips_of_while_loops():
    def while_eqn(fn, *args):
        return next(e for e, _, _ in jaxprs.walk(_jaxpr(fn, *args)) if e.primitive.name == "while")

    counted = lambda x: jax.lax.while_loop(lambda c: c[0] < 7, lambda c: (c[0] + 1, c[1]), (0, x))
    assert jaxprs.loop_trips(while_eqn(counted, X)) == 7
    by_two = lambda x: jax.lax.while_loop(lambda c: c[0] < 7, lambda c: (c[0] + 2, c[1]), (0, x))
    assert jaxprs.loop_trips(while_eqn(by_two, X)) == 1
    traced = lambda x, n: jax.lax.fori_loop(0, n, lambda i, h: h + 1, x)
    assert jaxprs.loop_trips(while_eqn(traced, X, 3)) == 1


def test_called_jaxpr_only_for_calls_on_exactly_their_operands():
    jaxpr = _jaxpr(lambda w, x: jax.jit(lambda x: x @ w)(x), W, X)
    (call,) = jaxpr.eqns
    inner = jaxprs.called_jaxpr(call)
    assert len(inner.invars) == len(call.invars) and inner.eqns[0].primitive.name == "dot_general"
    (scan,) = _jaxpr(lambda x: jax.lax.scan(lambda c, _: (c, None), x, None, length=2)[0],
                     X).eqns
    assert jaxprs.called_jaxpr(scan) is None
    assert jaxprs.called_jaxpr(_jaxpr(jnp.sin, X).eqns[0]) is None


def test_the_use_def_index():
    jaxpr = _jaxpr(lambda x: (jnp.sin(x) * x * x + 1.0, x), X)
    (x,) = jaxpr.invars
    uses = jaxprs.Uses(jaxpr)
    names = lambda eqns: [e.primitive.name for e in eqns]
    assert names(uses.users[x]) == ["sin", "mul", "mul"]  # in order, once per operand read
    assert uses.outputs == set(jaxpr.outvars)
    assert uses.producer[jaxpr.outvars[0]].primitive.name == "add"
    assert not any(compat.is_literal(v) for v in uses.users)  # the 1.0 is skipped
    assert uses.users.get(jaxpr.outvars[0]) is None  # returned, read by no equation
    by_index = jaxprs.Uses(jaxpr, positions=True)
    assert by_index.users[x] == [0, 1, 2]
    assert by_index.producer[jaxpr.outvars[0]] == len(jaxpr.eqns) - 1
    # Several jaxprs, one after another: each variable's readers in the order added.
    inner = jaxprs.called_jaxpr(_jaxpr(lambda x: jax.jit(jnp.cos)(x), X).eqns[0])
    both = jaxprs.Uses()
    both.add(jaxpr)
    both.add(inner)
    assert names(both.users[inner.invars[0]]) == ["cos"] and names(both.users[x]) == names(
        uses.users[x])
    assert both.outputs == set(jaxpr.outvars) | set(inner.outvars)


def test_nested_producers_name_the_enclosing_equations():
    jaxpr = _jaxpr(lambda w, x: jnp.sum(jax.jit(lambda x: jnp.tanh(x @ w))(x)), W, X)
    producers = jaxprs.nested_producers(jaxpr)
    call = jaxpr.eqns[0]
    inner = jaxprs.called_jaxpr(call)
    eqn, enclosing = producers[inner.outvars[0]]
    assert eqn.primitive.name == "tanh" and enclosing == (call,)
    assert producers[call.outvars[0]] == (call, ())


def _product_eqn(fn, *args):
    return next(e for e, _, _ in jaxprs.walk(_jaxpr(fn, *args))
                if e.primitive.name in ("dot_general", "conv_general_dilated"))


@pytest.mark.parametrize("spec, shapes, macs", [
    ("ij,jk->ik", ((4, 8), (8, 3)), 4 * 8 * 3),
    ("bij,bjk->bik", ((2, 4, 8), (2, 8, 3)), 2 * 4 * 8 * 3),
    ("bij,bkj->bik", ((2, 4, 8), (2, 3, 8)), 2 * 4 * 8 * 3),
    ("i,i->", ((16,), (16,)), 16),
])
def test_eqn_flops_of_a_dot_general(spec, shapes, macs):
    eqn = _product_eqn(functools.partial(jnp.einsum, spec), *map(jnp.ones, shapes))
    assert jaxprs.eqn_flops(eqn) == 2 * macs
    assert float8.product_of(eqn, "").flops == 2 * macs  # float8's rules count with it


def test_eqn_flops_of_a_convolution():
    conv = lambda x, k: jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", feature_group_count=2)
    x, k = jnp.ones((2, 4, 8, 8)), jnp.ones((6, 2, 3, 3))  # NCHW; OIHW, two groups
    eqn = _product_eqn(conv, x, k)
    # Each of the 2*6*8*8 outputs takes 2*3*3 multiply-adds (its group's input features).
    assert jaxprs.eqn_flops(eqn) == 2 * (2 * 6 * 8 * 8) * (2 * 3 * 3)
    assert float8.product_of(eqn, "").flops == jaxprs.eqn_flops(eqn)


def test_the_census_counts_with_eqn_flops():
    jaxpr = _jaxpr(jax.grad(_loop_in_loop), W, X)
    total = sum(flops for _, flops, _ in census.census(jaxpr))
    assert total == sum(times * jaxprs.eqn_flops(e) for e, times, _ in jaxprs.walk(jaxpr)
                        if e.primitive.name == "dot_general") == 3 * 5 * 3 * ONE


@pytest.mark.parametrize("ct_first", [False, True])
@pytest.mark.parametrize("dims, shapes", [
    ((((1,), (0,)), ((), ())), ((3, 4), (4, 5))),
    ((((2,), (1,)), ((0,), (0,))), ((2, 3, 4), (2, 4, 5))),
    ((((1,), (2,)), ((0,), (0,))), ((2, 4, 3), (2, 5, 4))),
    ((((1, 3), (2, 0)), ((), ())), ((3, 4, 6, 2), (2, 5, 4))),
])
def test_dot_transposes_are_the_gradients_of_dot_general(ct_first, dims, shapes):
    a, b = (jax.random.normal(jax.random.key(i), s) for i, s in enumerate(shapes))
    out, vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dims), a, b)
    ct = jax.random.normal(jax.random.key(2), out.shape)
    operands = []

    def product(x, y, dimension_numbers):
        operands.append((x is ct, y is ct))
        return jax.lax.dot_general(x, y, dimension_numbers)

    da, db = jaxprs.dot_transposes(ct, a, b, dims, product, ct_first=ct_first)
    want_a, want_b = vjp(ct)
    np.testing.assert_allclose(da, want_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, want_b, rtol=1e-5, atol=1e-5)
    # The cotangent is on the left of b's gradient only with ct_first (JAX's own rule).
    assert operands == [(True, False), (True, False) if ct_first else (False, True)]


def test_over_arrays_traces_the_array_leaves_only():
    def fn(w, activation, *, x, scale=None):
        return {"out": activation(x @ w) * scale}

    call, dynamic = jaxprs.over_arrays(fn, (W, jnp.tanh), {"x": X, "scale": 2.0})
    (w, activation), kwargs = dynamic
    assert w is W and activation is None and kwargs["x"] is X
    assert kwargs["scale"] is None  # a Python float is not an array
    closed, out = jax.make_jaxpr(call, return_shape=True)(dynamic)
    assert len(closed.jaxpr.invars) == 2 and out["out"].shape == (4, 8)
    assert np.allclose(call(dynamic)["out"], 2 * jnp.tanh(X @ W))
    # Another predicate: shapes are traced too.
    spec = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    _, dynamic = jaxprs.over_arrays(fn, (W, jnp.tanh), {"x": spec},
                                    lambda v: isinstance(v, (jax.Array, jax.ShapeDtypeStruct)))
    assert dynamic[1]["x"] is spec


def test_at_positions_splits_and_rebuilds_the_chosen_arguments():
    args = ({"w": W, "steps": jnp.arange(3)}, "static", X)
    chosen, rebuild = jaxprs.at_positions(args, (0, 2))
    assert chosen[0]["w"] is W and chosen[0]["steps"] is None and chosen[1] is X
    full = rebuild(({"w": 2 * W, "steps": None}, 3 * X))
    assert full[1] == "static" and full[0]["steps"] is args[0]["steps"]
    assert np.array_equal(full[0]["w"], 2 * W) and np.array_equal(full[2], 3 * X)
    ints, _ = jaxprs.at_positions(args, (0,), lambda v: v.dtype == jnp.int32)
    assert ints[0]["w"] is None and ints[0]["steps"] is args[0]["steps"]


def _scanned(w, x):
    return jnp.sum(jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=5)[0])


def _fori(w, x):
    return jnp.sum(jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), x))


@pytest.mark.parametrize("loss, trips", [(_scanned, 5), (_fori, 3), (_loop_in_loop, 15)])
def test_the_public_flop_counters_agree_on_loops(loss, trips):
    # matmul_flops counts the lowered StableHLO, precision_report the jaxpr (the census): a loop
    # body counts once per iteration in both. Differentiated, each iteration has three products:
    # the forward one, w's gradient and that of the carry (earlier iterations depend on w).
    for fn, products in ((loss, 1), (jax.grad(loss), 3)):
        want = {"float32": trips * products * ONE}
        assert jaxmp.debug.matmul_flops(fn, W, X) == want
        assert jaxmp.debug.precision_report(fn, W, X).totals == want
    step = jaxmp.mp_value_and_grad(loss, compute_dtype=jnp.bfloat16)
    state = jaxmp.noop_scaler()
    want = {"bfloat16": trips * 3 * ONE}
    assert jaxmp.debug.matmul_flops(step, W, X, scaler_state=state) == want
    assert jaxmp.debug.precision_report(step, W, X, scaler_state=state).totals == want


def test_shape_dtype_is_the_leaf_as_jit_traces_it():
    # NumPy's int64 and float64 become int32 and float32 without x64, silently, as under jit.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [jaxprs.shape_dtype(x) for x in (np.arange(3), np.ones(2), W, jnp.ones(2, jnp.int8))]
    assert [(s.shape, s.dtype) for s in got] == [
        ((3,), jnp.int32), ((2,), jnp.float32), ((8, 8), jnp.float32), ((2,), jnp.int8)]
    assert not caught
    key = jaxprs.shape_dtype(jax.random.key(0))  # a typed PRNG key keeps its dtype
    assert key.dtype == jax.random.key(0).dtype


def _edge_loss(w, batch):
    """A message-passing loss: features gathered by ``senders``, summed by ``receivers``."""
    messages = jnp.tanh(batch["nodes"][batch["senders"]] @ w)
    nodes = jax.ops.segment_sum(messages, batch["receivers"], num_segments=W.shape[0])
    return jnp.mean(nodes ** 2)


# A jraph-style batch: float32 features and NumPy's default int64 indices (np.arange).
_EDGES = {"nodes": np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8),
          "senders": np.arange(10) % 8, "receivers": np.arange(10)[::-1] % 8}
_TOOLS = {
    "matmul_flops": lambda b: jaxmp.debug.matmul_flops(_edge_loss, W, b),
    "half_matmul_flop_share": lambda b: jaxmp.debug.half_matmul_flop_share(_edge_loss, W, b),
    "float8_matmul_flop_share": lambda b: jaxmp.debug.float8_matmul_flop_share(_edge_loss, W, b),
    "saved_activation_bytes": lambda b: jaxmp.debug.saved_activation_bytes(_edge_loss, W, b),
    "precision_report": lambda b: jaxmp.debug.precision_report(_edge_loss, W, b).layers,
    "find_nonfinite": lambda b: str(jaxmp.debug.find_nonfinite(_edge_loss)(W, b)),
    "mp_value_and_grad": lambda b: jax.jit(jaxmp.mp_value_and_grad(
        _edge_loss, compute_dtype=jnp.bfloat16))(W, b, scaler_state=jaxmp.noop_scaler())[:2],
}


@pytest.mark.parametrize("tool", list(_TOOLS))
def test_the_tools_take_numpy_int64_leaves_silently_as_jit_does(tool):
    # jax.jit traces NumPy int64 leaves as int32 without a word; the FLOP counters stood them
    # in by jax.ShapeDtypeStruct(x.shape, x.dtype), and JAX warned that it truncates int64,
    # once per leaf and trace (12 times for a graph net's batch on jax 0.12).
    int32 = {k: jnp.asarray(v, jnp.int32) if k != "nodes" else v for k, v in _EDGES.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _TOOLS[tool](_EDGES)
    assert [str(c.message) for c in caught if issubclass(c.category, UserWarning)] == []
    if tool == "mp_value_and_grad":  # against float32's loss and gradient
        want = jax.jit(jax.value_and_grad(_edge_loss))(W, int32)
        assert helpers.rel(got[0], want[0]) < 0.01 and helpers.rel(got[1], want[1]) < 0.05
    else:
        assert got == _TOOLS[tool](int32)
