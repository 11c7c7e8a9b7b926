"""Tests of jaxmp._src.policy."""

import jax
import jax.numpy as jnp
import pytest

import jaxmp


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("params=float32,compute=bfloat16,output=float32", (jnp.float32, jnp.bfloat16, jnp.float32)),
        ("p=f32,c=bf16,o=f32", (jnp.float32, jnp.bfloat16, jnp.float32)),
        ("p=f32,c=f16", (jnp.float32, jnp.float16, jnp.float16)),
        ("c=bf16", (jnp.float32, jnp.bfloat16, jnp.bfloat16)),
        (" params = float16 , output = float32 ", (jnp.float16, jnp.float16, jnp.float32)),
        ("bfloat16", (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16)),
    ],
)
def test_get_policy_parses_jmp_format(spec, expected):
    policy = jaxmp.get_policy(spec)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == tuple(
        jnp.dtype(d) for d in expected)
    # str() gives the long form, which parses back to the same policy.
    assert jaxmp.get_policy(str(policy)) == policy


@pytest.mark.parametrize(
    "spec, message",
    [
        ("params=float32,compute=half", "Unknown dtype 'half'"),
        ("weights=f32", "Unknown policy field 'weights'"),
        ("p=f32,p=f16", "given twice"),
        ("p=f32,bf16", "Expected name=dtype"),
        ("int8", "Unknown dtype 'int8'"),
    ],
)
def test_get_policy_rejects_bad_strings(spec, message):
    with pytest.raises(ValueError, match=message):
        jaxmp.get_policy(spec)


def test_policy_casts_trees():
    policy = jaxmp.Policy(jnp.float32, jnp.float16, jnp.bfloat16)
    tree = {"x": jnp.ones(2, jnp.float32), "i": jnp.arange(2), "key": jax.random.key(0)}
    assert policy.cast_to_compute(tree)["x"].dtype == jnp.float16
    assert policy.cast_to_output(tree)["x"].dtype == jnp.bfloat16
    assert policy.cast_to_param(policy.cast_to_compute(tree))["x"].dtype == jnp.float32
    assert policy.cast_to_compute(tree)["i"] is tree["i"]
    assert policy.with_output_dtype(jnp.float32).output_dtype == jnp.float32


def test_policy_is_hashable_and_validated():
    assert len({jaxmp.get_policy("p=f32,c=f16"), jaxmp.Policy("float32", "float16", "float16")}) == 1
    with pytest.raises(ValueError, match="compute_dtype must be a floating-point dtype"):
        jaxmp.Policy(jnp.float32, jnp.int32, jnp.float32)
