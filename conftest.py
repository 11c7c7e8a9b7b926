"""Test configuration (tests and doctests): several CPU devices, strict promotion.

Both must be set before JAX initialises its backends, so they live here, at
import time of the test session.
"""

import jax

# Multi-device behaviour is tested on CPU with several host devices.
jax.config.update("jax_num_cpu_devices", 4)
# A mixed-precision library must never rely on implicit promotion
# (bfloat16 * float32 -> float32 silently throws the saving away).
jax.config.update("jax_numpy_dtype_promotion", "strict")
