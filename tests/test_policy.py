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


# What str(jmp.get_policy(spec)) returns in jmp 0.0.4: jmp names float32 "full".
JMP_WRITES = {
    "c=bf16": ("p=full,c=bf16,o=bf16", (jnp.float32, jnp.bfloat16, jnp.bfloat16)),
    "p=f32,c=f16": ("p=full,c=f16,o=f16", (jnp.float32, jnp.float16, jnp.float16)),
    "p=f16,c=bf16,o=f32": ("p=f16,c=bf16,o=full", (jnp.float16, jnp.bfloat16, jnp.float32)),
    "f32": ("p=full,c=full,o=full", (jnp.float32, jnp.float32, jnp.float32)),
    "bf16": ("p=bf16,c=bf16,o=bf16", (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16)),
    "f64": ("p=f64,c=f64,o=f64", (jnp.float64, jnp.float64, jnp.float64)),
}


@pytest.mark.parametrize("spec", sorted(JMP_WRITES))
def test_get_policy_reads_what_jmp_writes(spec):
    written, expected = JMP_WRITES[spec]
    policy = jaxmp.get_policy(written)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == tuple(
        jnp.dtype(d) for d in expected)
    assert policy == jaxmp.get_policy(spec)


@pytest.mark.parametrize("spec", sorted(JMP_WRITES))
def test_get_policy_reads_jmps_own_strings(spec):
    jmp = pytest.importorskip("jmp")  # an optional peer library ("peers" extra)
    theirs = jmp.get_policy(spec)
    assert str(theirs) == JMP_WRITES[spec][0]  # the strings above are jmp's
    ours = jaxmp.get_policy(str(theirs))
    expected = (theirs.param_dtype, theirs.compute_dtype, theirs.output_dtype)
    assert (ours.param_dtype, ours.compute_dtype, ours.output_dtype) == tuple(
        jnp.dtype(d) for d in expected)


@pytest.mark.parametrize("spec", ["half", "p=full,c=half", "c=half"])
def test_get_policy_rejects_half_and_says_why(spec):
    with pytest.raises(ValueError, match=r"Unknown dtype 'half'.*backend-dependent.*f16 or bf16"):
        jaxmp.get_policy(spec)
