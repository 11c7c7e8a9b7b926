"""The optimizer and scaler part of jaxmp's step in the H100 program (issue 41 part 2).

jaxmp's step adds to optax's update the finiteness check of the gradients, the select that
keeps parameters and optimizer state bit for bit on a skipped step, and the scaler's
update (counters, the record of skipped steps and alarms). Compiled for an H100 without a
GPU (marked ``gpu_program``, skipped without JAX's CUDA plugin, as in
``tests/test_gpu_program.py``), these tests pin what that costs over optax alone: the
select fused into the optimizer's own kernels (no byte more written), one reduction for the
check, and a scaler update of few kernels (each small kernel costs a launch, ~3 us).
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxmp
from jaxmp._src import gpu_program as gp

needs_plugin = pytest.mark.skipif(
    not gp.plugin_installed(),
    reason="needs JAX's CUDA plugin to compile for a GPU without one: "
           "pip install -e '.[gpu-compile]' (and JAX_PLATFORMS=cpu on a machine without a GPU)")

# The parameters of a small conv net: kernels, batch-norm scales and biases, a classifier.
_PARAMS = {
    "conv0": {"kernel": jax.ShapeDtypeStruct((3, 3, 3, 16), jnp.float32)},
    "bn0": {"scale": jax.ShapeDtypeStruct((16,), jnp.float32),
            "bias": jax.ShapeDtypeStruct((16,), jnp.float32)},
    "conv1": {"kernel": jax.ShapeDtypeStruct((3, 3, 16, 32), jnp.float32)},
    "bn1": {"scale": jax.ShapeDtypeStruct((32,), jnp.float32),
            "bias": jax.ShapeDtypeStruct((32,), jnp.float32)},
    "dense": {"kernel": jax.ShapeDtypeStruct((32, 10), jnp.float32),
              "bias": jax.ShapeDtypeStruct((10,), jnp.float32)},
}
_OPTIMIZER = optax.adam(1e-3)


def _optax_alone(params, opt_state, grads, scaler):
    """The hand-written step's update: optax, no check."""
    with jax.numpy_dtype_promotion("standard"):
        updates, opt_state = _OPTIMIZER.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, scaler


def _jaxmp(params, opt_state, grads, scaler):
    """jaxmp's: the check (as mp_value_and_grad makes it), the scaler, the guarded update."""
    finite = jaxmp.all_finite(grads)
    scaler = jaxmp.adjust(scaler, finite)
    params, opt_state = jaxmp.optimizer_update(params, _OPTIMIZER, opt_state, grads, finite)
    return params, opt_state, scaler


@functools.lru_cache(maxsize=None)
def _program(part: str) -> jaxmp.debug.GpuProgram:
    fn = {"optax": _optax_alone, "jaxmp": _jaxmp}[part]
    opt_state = jax.eval_shape(_OPTIMIZER.init, _PARAMS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return jaxmp.debug.gpu_program(jax.jit(fn, donate_argnums=(0, 1, 3)), _PARAMS,
                                       opt_state, _PARAMS, jaxmp.noop_scaler(), target="h100")


@pytest.mark.gpu_program
@needs_plugin
@pytest.mark.parametrize("scaler", [jaxmp.noop_scaler, jaxmp.init_scaler], ids=["noop", "dynamic"])
def test_scaler_update_is_at_most_10_kernels(scaler):
    # 16 while adjust stacked the state's pairs and summed the skip bits (issue 41 part 2).
    program = jaxmp.debug.gpu_program(jax.jit(jaxmp.adjust, donate_argnums=0), scaler(),
                                      jnp.asarray(True), target="h100")
    assert program.launches <= 10


@pytest.mark.gpu_program
@needs_plugin
def test_skip_guard_writes_nothing_more_than_optax():
    # The select of a skipped step is fused into Adam's own kernels: what the guarded
    # step writes beyond optax's update is the scaler's state (100 bytes) and the copies
    # of a few of its fields into their donated buffers.
    scaler = sum(x.nbytes for x in jax.tree_util.tree_leaves(jaxmp.noop_scaler()))
    assert _program("jaxmp").bytes_written <= _program("optax").bytes_written + 2 * scaler


@pytest.mark.gpu_program
@needs_plugin
def test_check_select_and_scaler_launch_at_most_12_kernels_over_optax():
    # One reduction for the check, the step count's select, at most 10 for the scaler
    # (18 while the scaler's update was 16 kernels).
    assert _program("jaxmp").launches <= _program("optax").launches + 12
