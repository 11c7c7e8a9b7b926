"""Tools to find out what a mixed-precision step does: non-finite values, precision, cost.

Nothing here is needed to train. These functions trace, evaluate or compile a
step to report on it: where an inf or NaN comes from (:func:`find_nonfinite`),
which operations ran in which precision (:func:`precision_report`), the share
of matrix-product FLOPs in half precision or float8, the bytes of activations
saved for the backward pass, and what XLA compiles for an NVIDIA GPU
(:func:`gpu_program`).

Examples:
    >>> import jax.numpy as jnp
    >>> import jaxmp
    >>> step = jaxmp.cast_function(lambda w, x: jnp.sum(x @ w), jnp.bfloat16)
    >>> jaxmp.debug.half_matmul_flop_share(step, jnp.ones((8, 8)), jnp.ones((4, 8)))
    1.0
"""

from jaxmp._src.casting import is_float_array
from jaxmp._src.census import MostlyFloat32Warning
from jaxmp._src.compat import UnknownEquationWarning
from jaxmp._src.diagnostics import float8_matmul_flop_share
from jaxmp._src.diagnostics import half_matmul_flop_share
from jaxmp._src.diagnostics import matmul_flops
from jaxmp._src.diagnostics import saved_activation_bytes
from jaxmp._src.gpu_program import gpu_program
from jaxmp._src.gpu_program import GpuProgram
from jaxmp._src.gpu_program import GpuTarget
from jaxmp._src.gpu_program import Kernel
from jaxmp._src.gpu_program import Product
from jaxmp._src.nonfinite import find_nonfinite
from jaxmp._src.nonfinite import Finding
from jaxmp._src.nonfinite import NonfiniteReport
from jaxmp._src.report import precision_report
from jaxmp._src.report import PrecisionReport

__all__ = (
    "find_nonfinite",
    "Finding",
    "float8_matmul_flop_share",
    "gpu_program",
    "GpuProgram",
    "GpuTarget",
    "half_matmul_flop_share",
    "is_float_array",
    "Kernel",
    "matmul_flops",
    "MostlyFloat32Warning",
    "NonfiniteReport",
    "precision_report",
    "PrecisionReport",
    "Product",
    "saved_activation_bytes",
    "UnknownEquationWarning",
)
