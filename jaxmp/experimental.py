"""Less mature features: float8 matrix products and optimizer state in low precision.

These work and are tested, but their interface may change between minor
versions more readily than the rest of jaxmp's. Float8 products are asked for
with ``matmul_dtype=jnp.float8_e4m3fn`` (of :func:`jaxmp.mp_value_and_grad`
and :func:`jaxmp.autocast`); :class:`Float8Rules` chooses which products run in
float8; :class:`NVFP4` switches the parts of the 4-bit recipe
(``float8_scaling="nvfp4"``, ``matmul_dtype=jnp.float4_e2m1fn``).
:func:`low_precision_optimizer` keeps an optimizer's state and the parameters
in bfloat16, with no float32 copy.

Examples:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> import jaxmp
    >>> tx = jaxmp.experimental.low_precision_optimizer(optax.adam(1e-3))
    >>> state = tx.init({"w": jnp.ones(4, jnp.bfloat16)})
    >>> type(state).__name__
    'LowPrecisionState'
"""

from jaxmp._src.shortfall import Float8PlacementWarning
from jaxmp._src.shortfall import Float8ShortfallWarning
from jaxmp._src.autocast import init_float8_state
from jaxmp._src.float8 import Float8Rules
from jaxmp._src.float8 import NVFP4
from jaxmp._src.float8.delayed import Float8State
from jaxmp._src.low_precision import low_precision_optimizer
from jaxmp._src.low_precision import LowPrecisionState

__all__ = (
    "Float8PlacementWarning",
    "Float8Rules",
    "Float8State",
    "Float8ShortfallWarning",
    "init_float8_state",
    "low_precision_optimizer",
    "LowPrecisionState",
    "NVFP4",
)
