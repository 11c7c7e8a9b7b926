"""Tests of jaxmp._src.casting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmp

HALF = [jnp.float16, jnp.bfloat16]
ALL_FLOAT = [jnp.float16, jnp.bfloat16, jnp.float32]


def _mixed_tree():
    return {
        "w": jnp.ones((2, 3), jnp.float32),
        "np_w": np.ones((2,), np.float32),
        "step": jnp.array(3, jnp.int32),
        "mask": jnp.array([True, False]),
        "raw_key": jax.random.PRNGKey(0),
        "typed_key": jax.random.key(1),
        "lr": 0.1,
        "n": 4,
        "name": "layer",
        "act": jax.nn.relu,
        "nothing": None,
        "nested": [jnp.zeros((1,), jnp.bfloat16), (np.arange(3), jnp.ones((), jnp.float16))],
    }


@pytest.mark.parametrize("dtype", ALL_FLOAT)
def test_cast_tree_casts_float_arrays_only(dtype):
    tree = _mixed_tree()
    out = jaxmp.cast_tree(tree, dtype)
    assert out["w"].dtype == dtype and isinstance(out["w"], jax.Array)
    assert out["np_w"].dtype == dtype and isinstance(out["np_w"], np.ndarray)
    assert out["nested"][0].dtype == dtype and out["nested"][1][1].dtype == dtype
    # Everything else is the very same object.
    for k in ("step", "mask", "raw_key", "typed_key", "lr", "n", "name", "act"):
        assert out[k] is tree[k], k
    assert out["nothing"] is None
    assert out["nested"][1][0] is tree["nested"][1][0]
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)


def test_cast_tree_keeps_values_and_keys_usable():
    tree = _mixed_tree()
    out = jaxmp.cast_tree(tree, jnp.bfloat16)
    # A key that went through the cast still draws the same numbers.
    np.testing.assert_array_equal(jax.random.normal(out["raw_key"], (3,)),
                                  jax.random.normal(tree["raw_key"], (3,)))
    np.testing.assert_array_equal(jax.random.normal(out["typed_key"], (3,)),
                                  jax.random.normal(tree["typed_key"], (3,)))


@pytest.mark.parametrize("bad", [jnp.int32, jnp.bool_, "not-a-dtype"])
def test_cast_tree_rejects_non_float_dtype(bad):
    with pytest.raises(ValueError, match="floating-point dtype"):
        jaxmp.cast_tree(jnp.ones(2), bad)


def test_cast_tree_under_jit():
    f = jax.jit(lambda t: jaxmp.cast_tree(t, jnp.float16))
    out = f({"w": jnp.ones(2), "i": jnp.arange(2)})
    assert out["w"].dtype == jnp.float16 and out["i"].dtype == jnp.int32


@pytest.mark.parametrize("dtype", HALF)
def test_cast_function_casts_args_kwargs_and_outputs(dtype):
    seen = {}

    def fn(x, *, y, n):
        seen["x"], seen["y"], seen["n"] = x.dtype, y.dtype, n
        return {"out": x * y, "aux": [x.sum()], "count": jnp.array(1)}

    f = jaxmp.cast_function(fn, dtype, return_dtype=jnp.float32)
    out = f(jnp.ones(2), y=jnp.ones(2), n=3)
    assert seen == {"x": dtype, "y": dtype, "n": 3}
    assert out["out"].dtype == jnp.float32 and out["aux"][0].dtype == jnp.float32
    assert out["count"].dtype == jnp.int32
    # Without return_dtype the outputs keep the compute dtype.
    assert jaxmp.cast_function(fn, dtype)(jnp.ones(2), y=jnp.ones(2), n=1)["out"].dtype == dtype


def test_force_full_precision_avoids_float16_overflow():
    x = jnp.full((2048,), 64.0, jnp.float16)  # sum = 131072 > float16 max 65504
    assert jnp.isinf(jnp.sum(x))
    total = jaxmp.force_full_precision(jnp.sum)(x)
    assert total.dtype == jnp.float32 and float(total) == 131072.0
    mean = jaxmp.force_full_precision(lambda v: jnp.sum(v) / v.shape[0], return_dtype=jnp.float16)(x)
    assert mean.dtype == jnp.float16 and float(mean) == 64.0


# Property tests -------------------------------------------------------------

_dtypes = st.sampled_from([np.float32, np.float16, np.int32, np.int8, np.bool_, np.uint32])
_leaf = st.one_of(
    st.tuples(st.integers(0, 3), _dtypes).map(lambda s: np.zeros((s[0],), s[1])),
    st.tuples(st.integers(0, 3), _dtypes).map(lambda s: jnp.zeros((s[0],), s[1])),
    st.floats(allow_nan=False, width=32),
    st.integers(-5, 5),
    st.none(),
    st.text(max_size=3),
)
_trees = st.recursive(
    _leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.text(max_size=2), children, max_size=3),
        st.tuples(children, children),
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(tree=_trees, dtype=st.sampled_from(ALL_FLOAT))
def test_property_cast_tree_preserves_structure_and_non_floats(tree, dtype):
    out = jaxmp.cast_tree(tree, dtype)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    for before, after in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(out)):
        if jaxmp.debug.is_float_array(before):
            assert after.dtype == jnp.dtype(dtype) and after.shape == before.shape
            assert type(after) is not np.ndarray or isinstance(before, np.ndarray)
        else:
            assert after is before


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(-60000, 60000, width=32), min_size=1, max_size=8))
def test_property_float32_round_trip_through_float16_is_nearest(values):
    x = jnp.asarray(values, jnp.float32)
    back = jaxmp.cast_tree(jaxmp.cast_tree(x, jnp.float16), jnp.float32)
    np.testing.assert_array_equal(back, np.asarray(values, np.float32).astype(np.float16).astype(np.float32))
