"""Test configuration (tests and doctests): several CPU devices, strict promotion.

Both must be set before JAX initialises its backends, so they live here, at
import time of the test session.
"""

import os

# The suite runs on CPU devices. With JAX's CUDA plugin installed (pip install -e
# ".[gpu-compile]", for the gpu_program tests) and no GPU, the plugin registers its
# platform for deviceless compilation only under JAX_PLATFORMS=cpu.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after the platform is chosen)

# Multi-device behaviour is tested on CPU with several host devices.
jax.config.update("jax_num_cpu_devices", 4)
# A mixed-precision library must never rely on implicit promotion
# (bfloat16 * float32 -> float32 silently throws the saving away).
jax.config.update("jax_numpy_dtype_promotion", "strict")
