"""Tests of the shared jaxpr interpreter (jaxmp._src.interpret)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import interpret


def _program(w, x):
    """Every higher-order primitive the interpreter handles, around small first-order ops."""

    @jax.custom_vjp
    def clip(h):
        return h

    clip.defvjp(lambda h: (h, None), lambda _, g: (jnp.clip(g, -0.1, 0.1),))

    def step(h, _):
        h = jax.checkpoint(lambda h: jnp.tanh(h @ w))(h)
        return h, jnp.sum(h)

    h, sums = jax.lax.scan(step, x, None, length=3)
    h = jax.jit(jax.nn.relu)(h)  # custom_jvp inside a jit
    h = jax.lax.cond(jnp.sum(h) > 0, lambda h: h * 2.0, lambda h: -h, h)
    n = jax.lax.while_loop(lambda i: i < 2, lambda i: i + 1, 0)  # not differentiable: ints only
    h = h * n.astype(h.dtype)
    return jnp.sum(clip(h)) + jnp.sum(sums)


def _interpreted(interp, fn):
    def run(*args):
        closed = jax.make_jaxpr(fn)(*args)
        (out,) = interp.eval_closed(closed, args)
        return out
    return run


W = jnp.full((4, 4), 0.3)
X = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)


class Recorder(interpret.Interpreter):
    def __init__(self, handlers=None):
        super().__init__(handlers)
        self.names = []

    def first_order(self, eqn, invals):
        self.names.append(eqn.primitive.name)
        return interpret.bind(eqn, invals)


def test_default_interpreter_reproduces_values_and_gradients():
    recorder = Recorder()
    run = _interpreted(recorder, _program)
    np.testing.assert_allclose(run(W, X), _program(W, X), rtol=1e-6)
    # Recursed into every body: the scan's dot_general and tanh, the cond's mul...
    assert {"dot_general", "tanh", "max", "mul", "lt", "reduce_sum"} <= set(recorder.names)
    # Custom derivative rules are kept: relu's at 0, and the clipped cotangent.
    grads = jax.grad(run, argnums=(0, 1))(W, X)
    expected = jax.grad(_program, argnums=(0, 1))(W, X)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-7)


def test_handlers_can_be_replaced():
    seen = []

    def scan_as_written(interp, eqn, invals):
        seen.append(eqn.params["length"])
        return interpret.bind(eqn, invals)  # the body is not interpreted

    recorder = Recorder({**interpret.HANDLERS, "scan": scan_as_written})
    np.testing.assert_allclose(_interpreted(recorder, _program)(W, X), _program(W, X), rtol=1e-6)
    assert seen == [3]
    assert "tanh" not in recorder.names  # tanh only occurs inside the scan
    assert "dot_general" not in recorder.names


def _low(x):
    return x.astype(jnp.float16) if jnp.issubdtype(x.dtype, jnp.floating) else x


class Shadow(interpret.Interpreter):
    """Values are pairs (value in float16, float32 shadow), as a pytree through every loop."""

    def literal(self, lit):
        x = super().literal(lit)
        return (_low(x), x)

    def const(self, array):
        return (_low(array), array)

    def loop_carry(self, values, avals):
        return [(_low(lo), hi) for lo, hi in values]

    def first_order(self, eqn, invals):
        lows = [_low(x) for x in interpret.bind(eqn, [lo for lo, _ in invals])]
        highs = interpret.bind(eqn, [hi for _, hi in invals])
        return list(zip(lows, highs))

    def to_original(self, value, aval):
        return value[1]

    def from_original(self, array, like):
        return (_low(array), array)


def test_client_values_may_be_pytrees():
    closed = jax.make_jaxpr(_program)(W, X)
    args = [(W.astype(jnp.float16), W), (X.astype(jnp.float16), X)]
    ((low, high),) = Shadow().eval_closed(closed, args)
    assert low.dtype == jnp.float16 and high.dtype == jnp.float32
    np.testing.assert_allclose(high, _program(W, X), rtol=1e-6)
    np.testing.assert_allclose(float(low), float(high), rtol=1e-2)


class Concreteness(Recorder):
    """Records, for each first-order equation, whether it was evaluated on traced values."""

    def __init__(self, handlers=None):
        super().__init__(handlers)
        self.traced = []

    def first_order(self, eqn, invals):
        self.traced.append(any(isinstance(x, jax.core.Tracer) for x in invals))
        return super().first_order(eqn, invals)


def _loops(x, ys):
    def step(c, y):
        c = c * 0.9 + y
        return c, jnp.sin(c)

    c, out = jax.lax.scan(step, x, ys, reverse=True)
    n, c = jax.lax.while_loop(lambda s: s[0] < 7, lambda s: (s[0] + 1, s[1] * 1.1), (0, c))
    return c + jnp.sum(out, 0) + n.astype(c.dtype)


def test_eager_handlers_evaluate_every_body_on_concrete_values():
    recorder = Concreteness(interpret.eager_handlers())
    np.testing.assert_allclose(_interpreted(recorder, _program)(W, X), _program(W, X), rtol=1e-6)
    assert recorder.names.count("tanh") == 3  # the scan's three iterations, one by one
    assert recorder.traced and not any(recorder.traced)  # nothing traced, nothing compiled whole
    ys = jnp.linspace(0.0, 1.0, 12).reshape(4, 3)
    recorder = Concreteness(interpret.eager_handlers())
    np.testing.assert_allclose(_interpreted(recorder, _loops)(X[0, :3], ys), _loops(X[0, :3], ys),
                               rtol=1e-6)
    assert recorder.names.count("sin") == 4 and recorder.names.count("lt") == 8
    assert not any(recorder.traced)
    # Pytree values (pairs) go through them as through the traced handlers.
    closed = jax.make_jaxpr(_program)(W, X)
    args = [(W.astype(jnp.float16), W), (X.astype(jnp.float16), X)]
    ((low, high),) = Shadow(interpret.eager_handlers()).eval_closed(closed, args)
    assert low.dtype == jnp.float16
    np.testing.assert_allclose(high, _program(W, X), rtol=1e-6)


def test_a_loop_past_the_eager_budget_is_traced(monkeypatch):
    monkeypatch.setattr(interpret, "EAGER_LOOP_BUDGET", 10)
    ys = jnp.linspace(0.0, 1.0, 12).reshape(4, 3)
    recorder = Concreteness(interpret.eager_handlers())
    np.testing.assert_allclose(_interpreted(recorder, _loops)(X[0, :3], ys), _loops(X[0, :3], ys),
                               rtol=1e-6)
    # The scan (4 x 3 equations) is traced whole; the while loop runs its first iterations one
    # by one, then the rest of it as a loop, from where it stood.
    assert recorder.names.count("sin") == 1 and recorder.traced[recorder.names.index("sin")]
    eager_lt = [t for n, t in zip(recorder.names, recorder.traced) if n == "lt" and not t]
    assert 0 < len(eager_lt) < 8 and any(recorder.traced)
