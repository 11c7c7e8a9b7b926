"""The table of float8 recipes, :data:`RECIPES`, and the products autocast runs from it.

One row per recipe module (``tensor.py``, ``mxfp8.py``, ``nvfp4.py``): a new recipe is its
module and one line here. :func:`check_scaling` checks ``float8_scaling=``
against the table, :func:`recipe_on` and :func:`recipe_for` choose the row
that runs on a target (a recipe's ``fallback`` where its GEMMs are not
native), and :func:`scaled_product` replaces an equation by that row's
product.
"""

from __future__ import annotations

from typing import Any, Iterable

import jax
import numpy as np

from jaxmp._src import compat
from jaxmp._src import interpret
from jaxmp._src.float8 import delayed
from jaxmp._src.float8 import mxfp8
from jaxmp._src.float8 import nvfp4
from jaxmp._src.float8 import tensor
from jaxmp._src.float8.recipe import Recipe
from jaxmp._src.float8.target import Target
from jaxmp._src.float8.target import compile_target


#: The float8 scaling recipes, by ``float8_scaling`` name: one row each, from its module.
RECIPES = {row.name: row for row in (tensor.RECIPE, mxfp8.RECIPE, delayed.RECIPE,
                                         nvfp4.RECIPE)}
#: The recipe used when none is named.
DEFAULT_RECIPE = "tensor"


def check_scaling(float8_scaling: Any, matmul_dtype: np.dtype | None) -> Recipe:
    """The :data:`RECIPES` row named ``float8_scaling``, for ``matmul_dtype`` (checked).

    ``matmul_dtype`` is what :func:`check_matmul_dtype` returned (``None``:
    products in the compute dtype). Raises a ``ValueError`` naming the problem
    and the fix for an unknown name, a recipe other than ``"tensor"`` without
    a float8 ``matmul_dtype``, or a ``matmul_dtype`` the recipe does not take.
    """
    if callable(getattr(float8_scaling, "as_recipe", None)):  # a recipe's options (NVFP4)
        recipe = float8_scaling.as_recipe()
    else:
        recipe = RECIPES.get(float8_scaling) if isinstance(float8_scaling, str) else None
    if recipe is None:
        hint = ""
        if isinstance(float8_scaling, str) and float8_scaling.lower() in RECIPES:
            hint = f" Names are lower case: float8_scaling={float8_scaling.lower()!r}."
        elif isinstance(float8_scaling, str) and "fp4" in float8_scaling.lower():
            hint = (" Of the 4-bit formats, NVFP4 is implemented: float8_scaling='nvfp4' "
                    "with matmul_dtype=jnp.float4_e2m1fn; MXFP4 is not.")
        rows = "; ".join(f"{name!r}{' (the default)' if name == DEFAULT_RECIPE else ''}: "
                         f"{row.summary}" for name, row in RECIPES.items())
        raise ValueError(
            f"float8_scaling must be one of {sorted(RECIPES)} ({rows}); got "
            f"{float8_scaling!r}." + hint)
    if matmul_dtype is None:
        if recipe.name != DEFAULT_RECIPE:
            raise ValueError(
                f"float8_scaling={recipe.name!r} scales float8 matrix products, but "
                "matmul_dtype is None (or the compute dtype): the products run in the compute "
                "dtype and there is nothing to scale.\n"
                f"  Fix: pass matmul_dtype=jnp.{recipe.matmul_dtypes[0].name} with "
                f"float8_scaling={recipe.name!r}, or leave float8_scaling out.")
        return recipe
    if np.dtype(matmul_dtype) not in recipe.matmul_dtypes:
        takes = " or ".join(f"jnp.{d.name}" for d in recipe.matmul_dtypes)
        name = np.dtype(matmul_dtype).name
        others = [r.name for r in RECIPES.values() if np.dtype(matmul_dtype) in r.matmul_dtypes]
        raise ValueError(
            f"float8_scaling={recipe.name!r} takes matmul_dtype={takes} ({recipe.summary}); "
            f"got {name}.\n"
            f"  Fix: matmul_dtype={takes}, or float8_scaling={others[0]!r} for {name} products"
            f" ({RECIPES[others[0]].summary}).")
    return recipe


def recipe_on(recipe: Recipe, target: Target) -> Recipe:
    """The recipe that runs ``recipe``'s products on ``target``.

    A recipe with a ``fallback`` runs where its GEMMs exist (its ``native``
    predicate: for a block-scaled one, GPUs with
    :func:`target.block_scaled_gemms`) and on the CPU (an emulation with the same
    numbers: the reference the tests check); on any other accelerator (Hopper
    and older NVIDIA GPUs, ROCm, TPU) its ``fallback`` runs instead, the
    per-tensor recipe's float8 GEMMs, which such hardware has.
    """
    if recipe.fallback is None or target.platform == "cpu" or recipe.native(target):
        return recipe
    return RECIPES[recipe.fallback]


def recipe_for(recipe: Recipe, avals: Iterable[Any]) -> tuple[Recipe, Target]:
    """``(recipe that runs, target)`` for a product of ``recipe`` with operands ``avals``:
    chosen when the product is traced (:func:`compile_target`, :func:`recipe_on`);
    ``jaxmp``'s census says so once when it is the fallback
    (``jaxmp.experimental.Float8ShortfallWarning``)."""
    target = compile_target(avals)
    return recipe_on(recipe, target), target


def scaled_product(eqn, invals, compute_dtype: np.dtype, matmul_dtype: np.dtype,
                   recipe: Recipe | None = None) -> jax.Array:
    """The float8 replacement of a ``dot_general`` or ``conv_general_dilated`` equation.

    ``recipe`` is a row of :data:`RECIPES` (default ``"tensor"``). The
    operands keep the dtypes they have (a float32 weight is quantized from
    float32); the result is in ``compute_dtype``. The new equations carry the
    source location of ``eqn`` (the user's line).
    """
    recipe = RECIPES[DEFAULT_RECIPE] if recipe is None else recipe
    recipe, _ = recipe_for(recipe, [v.aval for v in eqn.invars])
    if matmul_dtype not in recipe.matmul_dtypes:  # a fallback's own dtype (float8 for float4)
        matmul_dtype = recipe.matmul_dtypes[0]
    a, b = invals
    with interpret.at_source_of(eqn):
        if eqn.primitive.name == "dot_general":
            return recipe.dot(a, b, dimension_numbers=compat.dimension_numbers(eqn),
                              matmul_dtype=matmul_dtype, out_dtype=compute_dtype)
        return recipe.conv(a, b, params=compat.params_for_bind(eqn), matmul_dtype=matmul_dtype,
                           out_dtype=compute_dtype)
