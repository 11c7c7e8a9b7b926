"""Graph networks (plain JAX, ``jax.ops.segment_sum``) under autocast against float32.

A message-passing layer gathers node features along edges (``h[senders]``)
and sums the messages into their receivers with ``segment_sum``: a
scatter-add forward and, as the transpose of the gather, a scatter-add of the
cotangents backward. Both are sums, and run in float32 under autocast.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from jaxmp._src import jaxprs

NODES, FEATURES, EDGES = 8, 4, 3000


def _graph():
    """A graph of 3000 edges from 8 nodes, every message into node 0, and its parameters."""
    k = jax.random.split(jax.random.key(0), 4)
    params = {"embed": jax.random.normal(k[0], (FEATURES, FEATURES)) / 2,
              "message": jax.random.normal(k[1], (FEATURES, FEATURES)) / 2}
    nodes = jax.random.normal(k[2], (NODES, FEATURES))
    senders = jax.random.randint(k[3], (EDGES,), 0, NODES, dtype=jnp.int32)
    receivers = jnp.zeros((EDGES,), jnp.int32)
    return params, nodes, senders, receivers


def _gnn_loss(params, nodes, senders, receivers):
    h = nodes @ params["embed"]
    messages = h[senders] @ params["message"]
    aggregated = jax.ops.segment_sum(messages, receivers, NODES)
    return jnp.sum(aggregated**2) / EDGES**2


@pytest.fixture(scope="module")
def reference():
    params, nodes, senders, receivers = _graph()
    loss, grads = jax.value_and_grad(_gnn_loss)(params, nodes, senders, receivers)
    return loss, grads


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _scatter_operands(fn, *args):
    """The dtypes of the floating operands of every scatter-add in the traced program of ``fn``."""
    closed = jax.make_jaxpr(fn)(*args)
    return [[str(v.aval.dtype) for v in eqn.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)]
            for eqn, _, _ in jaxprs.walk(closed.jaxpr) if eqn.primitive.name == "scatter-add"]


# Gradient error against float32: before the backward scatter-add ran in float32, 2.0e-2
# (float16) and 0.26 (bfloat16) for the embedding; now 7e-4 and 8e-3, the products' rounding.
GRAD_RTOL = {jnp.float16: 5e-3, jnp.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_mp_value_and_grad_sums_messages_in_float32(dtype, reference):
    params, nodes, senders, receivers = _graph()
    step = jaxmp.mp_value_and_grad(_gnn_loss, compute_dtype=dtype)
    state = (jaxmp.init_scaler(initial_scale=2.0**10) if dtype == jnp.float16
             else jaxmp.noop_scaler())
    operands = _scatter_operands(
        lambda p: step(p, nodes, senders, receivers, scaler_state=state), params)
    # The segment_sum forward, and the transpose of the gather backward.
    assert len(operands) == 2 and all(d == ["float32", "float32"] for d in operands), operands
    loss, grads, _, finite = jax.jit(step)(params, nodes, senders, receivers, scaler_state=state)
    ref_loss, ref_grads = reference
    assert bool(finite)
    assert _rel(loss, ref_loss) < 2e-2
    for name in params:
        assert grads[name].dtype == jnp.float32
        assert _rel(grads[name], ref_grads[name]) < GRAD_RTOL[dtype], name


def _half_messages():
    k1, k2 = jax.random.split(jax.random.key(1))
    h = jax.random.normal(k1, (NODES, FEATURES)).astype(jnp.float16)
    w = (jax.random.normal(k2, (FEATURES, FEATURES)) / 2).astype(jnp.float16)
    return h, w


def _layer(h, w, senders, receivers):
    return jax.ops.segment_sum(h[senders] @ w, receivers, NODES)


def test_autocast_of_float16_inputs_sums_in_float32():
    _, _, senders, receivers = _graph()
    h, w = _half_messages()
    messages = (h[senders].astype(jnp.float32) @ w.astype(jnp.float32)).astype(jnp.float16)
    segment_sum = jaxmp.autocast(lambda m, r: jax.ops.segment_sum(m, r, NODES), jnp.float16)
    assert _scatter_operands(segment_sum, messages, receivers) == [["float32", "float32"]]
    out = segment_sum(messages, receivers)
    ref = jax.ops.segment_sum(messages.astype(jnp.float32), receivers, NODES)
    assert out.dtype == jnp.float16
    assert _rel(out, ref) < 1e-3  # 5.5e-2 summed in float16

    def loss(h, w):
        return jnp.sum(_layer(h, w, senders, receivers) ** 2) / EDGES

    grad = jax.grad(jaxmp.autocast(loss, jnp.float16))
    ref_grad = jax.grad(loss)(h.astype(jnp.float32), w.astype(jnp.float32))
    assert all(d == ["float32", "float32"] for d in _scatter_operands(grad, h, w))
    assert _rel(grad(h, w), ref_grad) < 3e-3  # 6.3e-2 with the cotangents summed in float16
