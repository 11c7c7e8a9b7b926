"""The one place where jaxmp meets JAX APIs that changed or are private (jaxmp/_src/compat.py)."""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxmp
from jaxmp._src import compat
from jaxmp._src import host

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_jaxmp_imports_no_private_jax_module_outside_compat():
    for path in (ROOT / "jaxmp").rglob("*.py"):
        if path.name == "compat.py":
            continue
        assert "jax._src" not in path.read_text(), path


def _eqn(fn, *args):
    return jax.make_jaxpr(fn)(*args).jaxpr.eqns[0]


def test_bind_params_rebinds_an_equation_to_the_same_result():
    eqn = _eqn(lambda x: jnp.sum(x, axis=1), jnp.ones((2, 3)))
    subfuns, params = compat.bind_params(eqn.primitive, eqn.params)
    assert isinstance(params, dict) and params["axes"] == (1,)
    x = jnp.arange(6.0).reshape(2, 3)
    out = eqn.primitive.bind(*subfuns, x, **params)
    np.testing.assert_array_equal(out, np.arange(6.0).reshape(2, 3).sum(1))


def test_bind_params_reads_both_forms_of_get_bind_params():
    class Old:  # jax <= 0.8
        def get_bind_params(self, params):
            return ["f"], params

    class New:
        def get_bind_params(self, params):
            return params

    assert compat.bind_params(Old(), {"a": 1}) == (["f"], {"a": 1})
    assert compat.bind_params(New(), {"a": 1}) == ([], {"a": 1})


def test_pcast_to_varying_types_a_value_as_varying_inside_shard_map():
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    seen = {}

    def body(x):
        replicated = jnp.zeros((), jnp.float32)
        seen["before"] = compat.varying_axes(replicated)
        seen["after"] = compat.varying_axes(compat.pcast_to_varying(replicated, ("data",)))
        seen["input"] = compat.varying_axes(x)
        return x

    jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(jnp.ones(8))
    assert seen == {"before": frozenset(), "after": frozenset({"data"}),
                    "input": frozenset({"data"})}
    assert compat.varying_axes(jnp.ones(3)) == frozenset()  # outside shard_map


@pytest.mark.parametrize("private", [True, False])
def test_user_frames_name_the_users_line(private):
    def f(x):
        return jnp.sin(x) * 2.0  # this line

    line = f.__code__.co_firstlineno + 1
    frames = compat.user_frames(_eqn(f, 1.0).source_info.traceback, private=private)
    assert frames, "no user frame"
    first = frames[0]
    assert (os.path.basename(first.file_name), first.function_name, first.start_line) == (
        "test_compat.py", f.__qualname__, line)
    jax_dir = os.path.dirname(jax.__file__)
    assert not any(os.path.abspath(fr.file_name).startswith(jax_dir) for fr in frames)
    assert compat.user_frames(None, private=private) == []


def test_find_nonfinite_names_the_line_without_the_private_api(monkeypatch):
    monkeypatch.setattr(compat, "_private_source_info", None)

    def loss(params, x):
        return jnp.sum(jnp.exp(x * params["w"]))  # overflows in float16

    report = jaxmp.find_nonfinite(loss, autocast=False,
                                  compute_dtype=jnp.float16)({"w": jnp.float32(30.0)}, jnp.ones(4))
    assert report.findings
    assert "test_compat.py" in str(report), str(report)


def test_no_host_callbacks_retraces_a_jitted_step_without_callbacks():
    calls = []

    @jax.jit
    def step(x):
        host.call_back_if(x > 0, lambda v: calls.append(float(v)), x)
        return x * 2

    step(jnp.float32(1.0)).block_until_ready()
    jax.effects_barrier()
    assert calls == [1.0]
    with host.no_host_callbacks():  # part of the trace cache key: traced again, without
        assert "callback" not in step.lower(jnp.float32(1.0)).as_text()
        step(jnp.float32(3.0)).block_until_ready()
    jax.effects_barrier()
    assert calls == [1.0]
    step(jnp.float32(2.0)).block_until_ready()  # and with them again outside
    jax.effects_barrier()
    assert calls == [1.0, 2.0]
