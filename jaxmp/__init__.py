"""jaxmp: mixed-precision training for JAX, as pure functions over explicit state.

The top level holds what a training step needs. Tools that inspect a step are
in :mod:`jaxmp.debug`; float8 rules and low-precision optimizer state, less
mature, are in :mod:`jaxmp.experimental`.
"""

from jaxmp import debug
from jaxmp import experimental
from jaxmp._src.accumulate import accumulate_value_and_grad
from jaxmp._src.autocast import autocast
from jaxmp._src.autocast import AutocastRules
from jaxmp._src.casting import cast_function
from jaxmp._src.casting import cast_tree
from jaxmp._src.casting import force_full_precision
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
from jaxmp._src.policy import get_policy
from jaxmp._src.policy import Policy
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
    "cast_tree",
    "force_full_precision",
    "get_policy",
    "init_scaler",
    "mp_grad",
    "mp_value_and_grad",
    "noop_scaler",
    "optimizer_update",
    "Policy",
    "scale",
    "scaler_for",
    "ScalerState",
    "scaler_metrics",
    "SkippedStepsWarning",
    "select_tree",
    "static_scaler",
    "TrainingStuckError",
    "TrainingStuckWarning",
    "unscale",
)

# Names that moved out of the top level: still reachable there for a release, with a warning.
_MOVED = {
    **{name: debug for name in debug.__all__},
    **{name: experimental for name in experimental.__all__},
}
# Deprecated aliases of `cast_tree` with a fixed dtype, and what to write instead.
_CAST_ALIASES = {
    "cast_to_float16": "jaxmp.cast_tree(tree, jnp.float16)",
    "cast_to_bfloat16": "jaxmp.cast_tree(tree, jnp.bfloat16)",
    "cast_to_float32": "jaxmp.cast_tree(tree, jnp.float32)",
    "cast_to_half_precision": "jaxmp.cast_tree(tree, jnp.float16) (or jnp.bfloat16)",
}


def __getattr__(name):
    """The names deprecated at the top level, with a ``DeprecationWarning`` (PEP 562)."""
    import warnings  # pylint: disable=g-import-not-at-top

    if name in _MOVED:
        home = f"{_MOVED[name].__name__}.{name}"
        warnings.warn(f"jaxmp.{name} has moved to {home}; the top-level name will be removed "
                      "in the next release.", DeprecationWarning, stacklevel=2)
        return getattr(_MOVED[name], name)
    if name in _CAST_ALIASES:
        from jaxmp._src import casting  # pylint: disable=g-import-not-at-top

        warnings.warn(f"jaxmp.{name} is deprecated and will be removed in the next release: "
                      f"use {_CAST_ALIASES[name]}.", DeprecationWarning, stacklevel=2)
        return getattr(casting, name)
    raise AttributeError(f"module 'jaxmp' has no attribute {name!r}")
