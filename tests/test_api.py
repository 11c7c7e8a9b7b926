"""The public API is what it claims to be, and the pinned names of issue 2 exist."""

import inspect

import jaxmp

PINNED = {
    "cast_tree", "cast_to_float16", "cast_to_bfloat16", "cast_to_float32", "cast_to_half_precision",
    "cast_function", "force_full_precision", "Policy", "get_policy", "init_scaler", "scale",
    "unscale", "adjust", "all_finite", "mp_value_and_grad", "mp_grad", "optimizer_update",
}


def test_all_is_exactly_the_public_names():
    public = {name for name in dir(jaxmp) if not name.startswith("_")}
    modules = {name for name in public if inspect.ismodule(getattr(jaxmp, name))}
    assert set(jaxmp.__all__) == public - modules
    assert len(jaxmp.__all__) == len(set(jaxmp.__all__))


def test_pinned_names_exist_and_are_documented():
    assert PINNED <= set(jaxmp.__all__)
    for name in jaxmp.__all__:
        assert getattr(jaxmp, name).__doc__, f"jaxmp.{name} has no docstring"


def test_scaler_state_is_keyword_only():
    import jax.numpy as jnp
    import pytest

    fn = jaxmp.mp_value_and_grad(lambda w: jnp.sum(w), compute_dtype=jnp.float16)
    with pytest.raises(TypeError, match="scaler_state"):
        fn(jnp.ones(2), jaxmp.init_scaler())
