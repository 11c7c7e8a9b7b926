"""A shard_map or pmap evaluated on one device, its body under vmaps (jaxmp/_src/one_device.py)."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxmp._src import interpret
from jaxmp._src import one_device
from jaxmp._src import source


def _mesh(shape, names):
    if jax.device_count() < int(np.prod(shape)):
        pytest.skip(f"needs {int(np.prod(shape))} devices")
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                         devices=jax.devices()[:int(np.prod(shape))])


def _shard_map_eqn(closed):
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            return eqn
        for value in eqn.params.values():
            if hasattr(value, "jaxpr") and hasattr(value, "consts"):
                found = _shard_map_eqn(value)
                if found is not None:
                    return found
    return None


def _on_one_device(fn, *args):
    """``fn``'s one shard_map, evaluated with ``as_batched`` on ``args`` (its operands)."""
    eqn = _shard_map_eqn(jax.make_jaxpr(fn)(*args))
    batched = one_device.as_batched(eqn)
    blocks = [batched.split(i, x) for i, x in enumerate(args)]
    outs = jax.core.eval_jaxpr(batched.jaxpr.jaxpr, batched.jaxpr.consts, *blocks)
    return [batched.merge(i, y) for i, y in enumerate(outs)], batched


def _named_axes(jaxpr) -> set:
    """The axis names any equation of ``jaxpr`` (nested ones included) still refers to."""
    found = set()
    for eqn in jaxpr.eqns:
        for key in ("axes", "axis_name"):
            value = eqn.params.get(key)
            values = value if isinstance(value, (tuple, list)) else (value,)
            found |= {v for v in values if isinstance(v, str)}
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                found |= _named_axes(inner)
    return found


def _tensor_parallel_body(w, x, b):
    """Collectives of every kind over a ("data", "model") mesh; the results are laid out in
    four ways (replicated, split over one axis, over two axes on one dimension, over each)."""
    h = x @ w  # x: [batch/data, in], w: [in, out/model]
    i = jax.lax.axis_index("model").astype(h.dtype)
    h = h + i + b.reshape(-1)[0]
    stats = jax.lax.pmean(jnp.mean(h, 0), "data")
    full = jax.lax.all_gather(h, "model", axis=1, tiled=True)
    shifted = jax.lax.ppermute(h, "data", perm=[(0, 1), (1, 0)])
    scattered = jax.lax.psum_scatter(full, "model", scatter_dimension=1, tiled=True)
    total = jax.lax.psum(jnp.sum(full ** 2) + jnp.sum(stats), ("data", "model"))
    return total, jax.lax.pmean(full, "model"), shifted + scattered, h.reshape(-1)


@pytest.mark.parametrize("check_vma", [True, False])
def test_a_two_axis_shard_map_gives_what_it_gives_on_devices(check_vma):
    mesh = _mesh((2, 2), ("data", "model"))
    keys = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(keys[0], (8, 6))
    x = jax.random.normal(keys[1], (4, 8))
    b = jax.random.normal(keys[2], (4, 2))
    fn = jax.shard_map(
        _tensor_parallel_body, mesh=mesh, check_vma=check_vma,
        in_specs=(P(None, "model"), P("data"), P(("data", "model"))),
        out_specs=(P(), P("data"), P("data", "model"), P(("data", "model"))))
    expected = jax.jit(fn)(w, x, b)
    got, batched = _on_one_device(fn, w, x, b)
    assert batched.axes == ("data", "model") and batched.sizes == {"data": 2, "model": 2}
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
    # No collective over a named axis is left: it runs eagerly, outside any mapping.
    assert not _named_axes(batched.jaxpr.jaxpr)


def test_a_mesh_axis_the_shard_map_leaves_automatic_is_not_mapped():
    mesh = _mesh((2, 2), ("data", "model"))

    def body(x):
        return jax.lax.psum(jnp.sum(x, 0), "data")

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P(), axis_names={"data"})
    x = jnp.arange(24.0).reshape(4, 6)
    got, batched = _on_one_device(fn, x)
    assert batched.axes == ("data",)
    np.testing.assert_allclose(got[0], jnp.sum(x, 0))


def test_the_gradient_of_a_shard_map_and_pmap():
    mesh = _mesh((2,), ("batch",))

    def loss(w, x):
        return jax.lax.pmean(jnp.mean(jnp.tanh(x @ w) ** 2), "batch")

    sharded = jax.shard_map(loss, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P())
    w = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    x = jnp.linspace(-2.0, 2.0, 24).reshape(6, 4)
    closed = jax.make_jaxpr(jax.grad(sharded))(w, x)
    # Every shard_map of the gradient's program (the forward and the transpose), on one device.
    grad = _Evaluate().eval_closed(closed, [w, x])[0]
    reference = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
    np.testing.assert_allclose(grad, reference, rtol=1e-5)

    # pmap is a shard_map too: the same, with the leading device axis.
    pmapped = jax.pmap(loss, axis_name="batch", in_axes=(None, 0), devices=jax.devices()[:2])
    got, _ = _on_one_device(pmapped, w, x.reshape(2, 3, 4))
    np.testing.assert_allclose(got[0], jnp.full((2,), jnp.mean(jnp.tanh(x @ w) ** 2)), rtol=1e-6)


class _Evaluate(interpret.Interpreter):
    """Evaluates a program, each shard_map on one device."""

    def __init__(self):
        super().__init__({**interpret.HANDLERS, "shard_map": self._shard_map})

    @staticmethod
    def _shard_map(interp, eqn, invals):
        batched = one_device.as_batched(eqn)
        blocks = [batched.split(i, x) for i, x in enumerate(invals)]
        outs = interp.eval_closed(batched.jaxpr, blocks)
        return [batched.merge(i, y) for i, y in enumerate(outs)]


def test_the_body_keeps_the_users_lines():
    mesh = _mesh((2,), ("batch",))

    def body(x):
        y = jnp.sin(x)  # the line to find
        return jax.lax.psum(y, "batch")

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("batch"), out_specs=P())
    _, batched = _on_one_device(fn, jnp.ones((4, 3)))
    (sin,) = [e for e in batched.jaxpr.jaxpr.eqns if e.primitive.name == "sin"]
    frame = source.frames(sin)[0]
    lines, start = inspect.getsourcelines(body)
    assert frame.file_name == __file__
    assert frame.start_line == start + lines.index("        y = jnp.sin(x)  # the line to find\n")
