"""jaxmp: mixed-precision training for JAX, as pure functions over explicit state."""

from jaxmp._src.accumulate import accumulate_value_and_grad
from jaxmp._src.autocast import autocast
from jaxmp._src.autocast import AutocastRules
from jaxmp._src.casting import cast_function
from jaxmp._src.casting import cast_to_bfloat16
from jaxmp._src.casting import cast_to_float16
from jaxmp._src.casting import cast_to_float32
from jaxmp._src.casting import cast_to_half_precision
from jaxmp._src.casting import cast_tree
from jaxmp._src.casting import force_full_precision
from jaxmp._src.casting import is_float_array
from jaxmp._src.census import MostlyFloat32Warning
from jaxmp._src.compat import UnknownEquationWarning
from jaxmp._src.diagnostics import float8_matmul_flop_share
from jaxmp._src.diagnostics import half_matmul_flop_share
from jaxmp._src.diagnostics import matmul_flops
from jaxmp._src.diagnostics import saved_activation_bytes
from jaxmp._src.float8 import Float8Rules
from jaxmp._src.gpu_program import gpu_program
from jaxmp._src.gpu_program import GpuProgram
from jaxmp._src.gpu_program import GpuTarget
from jaxmp._src.grad import mp_grad
from jaxmp._src.grad import mp_value_and_grad
from jaxmp._src.loss_scale import adjust
from jaxmp._src.loss_scale import all_finite
from jaxmp._src.loss_scale import init_scaler
from jaxmp._src.loss_scale import noop_scaler
from jaxmp._src.loss_scale import scale
from jaxmp._src.loss_scale import scaler_for
from jaxmp._src.loss_scale import ScalerState
from jaxmp._src.loss_scale import scaler_metrics
from jaxmp._src.loss_scale import SkippedStepsWarning
from jaxmp._src.loss_scale import static_scaler
from jaxmp._src.loss_scale import TrainingStuckError
from jaxmp._src.loss_scale import TrainingStuckWarning
from jaxmp._src.loss_scale import unscale
from jaxmp._src.low_precision import low_precision_optimizer
from jaxmp._src.low_precision import LowPrecisionState
from jaxmp._src.nonfinite import find_nonfinite
from jaxmp._src.nonfinite import Finding
from jaxmp._src.nonfinite import NonfiniteReport
from jaxmp._src.policy import get_policy
from jaxmp._src.policy import Policy
from jaxmp._src.report import precision_report
from jaxmp._src.report import PrecisionReport
from jaxmp._src.shortfall import Float8ShortfallWarning
from jaxmp._src.update import optimizer_update
from jaxmp._src.update import select_tree

__version__ = "0.1.0"

__all__ = (
    "accumulate_value_and_grad",
    "adjust",
    "all_finite",
    "autocast",
    "AutocastRules",
    "cast_function",
    "cast_to_bfloat16",
    "cast_to_float16",
    "cast_to_float32",
    "cast_to_half_precision",
    "cast_tree",
    "find_nonfinite",
    "Finding",
    "Float8Rules",
    "Float8ShortfallWarning",
    "float8_matmul_flop_share",
    "force_full_precision",
    "get_policy",
    "gpu_program",
    "GpuProgram",
    "GpuTarget",
    "half_matmul_flop_share",
    "init_scaler",
    "is_float_array",
    "low_precision_optimizer",
    "LowPrecisionState",
    "matmul_flops",
    "mp_grad",
    "MostlyFloat32Warning",
    "mp_value_and_grad",
    "noop_scaler",
    "NonfiniteReport",
    "optimizer_update",
    "Policy",
    "precision_report",
    "PrecisionReport",
    "scale",
    "saved_activation_bytes",
    "scaler_for",
    "ScalerState",
    "scaler_metrics",
    "SkippedStepsWarning",
    "select_tree",
    "static_scaler",
    "TrainingStuckError",
    "TrainingStuckWarning",
    "UnknownEquationWarning",
    "unscale",
)
