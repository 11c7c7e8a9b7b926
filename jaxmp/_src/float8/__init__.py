"""float8 matrix products for ``autocast``: a table of scaling recipes.

``jaxmp.autocast(fn, compute_dtype, matmul_dtype=jnp.float8_e4m3fn)`` replaces
every matrix product of ``fn`` by a scaled float8 product; ``float8_scaling=``
names the recipe that scales it, a row of :data:`RECIPES`. The package, from
the bottom up (a module imports only those above it in this list):

* ``rules.py``: which products run in float8 and in which dtypes
  (:class:`Float8Rules`, :data:`COSTLY`, :func:`placement`, :func:`conv_float8_products`,
  :func:`check_matmul_dtype`);
* ``scaling.py``: the power-of-two scale arithmetic and quantisation every
  recipe shares (:func:`scale_exponent`, :func:`scale_for`);
* ``target.py``: where a product runs and which GPUs run which GEMMs
  natively (:class:`Target`, :func:`describe`, :func:`block_scaled_gemms`);
* ``blocks.py``: the block-scaled products the block-scaled recipes share
  (their ``(B, F, K)`` layout, cuDNN's block-scaled dot and its CPU
  emulation);
* ``recipe.py``: the row type, :class:`Recipe`: what a recipe quantises, its
  scales, its state, where it runs natively, its fallback;
* ``convolution.py``: the float8 convolution scaled per tensor, which every
  recipe runs its convolutions with;
* one module per recipe, each defining its row ``RECIPE`` and importing none
  of the others: ``tensor.py`` (``"tensor"``: one scale per tensor, the
  default), ``mxfp8.py`` (``"mxfp8"``: OCP MXFP8, one scale per block of
  32, :func:`mx_quantize`) and ``nvfp4.py`` (``"nvfp4"``: NVIDIA's NVFP4,
  float4 elements with a float8 scale per block of 16 and a float32 scale per
  tensor, whose options are :class:`NVFP4`);
* ``table.py``: :data:`RECIPES`, one line per recipe module, and what is
  chosen from it (:func:`check_scaling`, :func:`recipe_on`,
  :func:`recipe_for`, :func:`scaled_product`).

A new recipe (delayed scaling) is a new module with its row and one
line in ``table.py``. This module is the package's face: it re-exports what
the rest of jaxmp uses, so callers write ``float8.placement`` and
``float8.RECIPES`` wherever the names live.
"""

from jaxmp._src.float8.mxfp8 import mx_quantize
from jaxmp._src.float8.nvfp4 import NVFP4
from jaxmp._src.float8.recipe import Recipe
from jaxmp._src.float8.recipe import StateSpec
from jaxmp._src.float8.rules import COSTLY
from jaxmp._src.float8.rules import FLOAT8_PRIMITIVES
from jaxmp._src.float8.rules import Float8Rules
from jaxmp._src.float8.rules import Product
from jaxmp._src.float8.rules import check_matmul_dtype
from jaxmp._src.float8.rules import conv_float8_products
from jaxmp._src.float8.rules import is_float8_dtype
from jaxmp._src.float8.rules import placement
from jaxmp._src.float8.rules import product_of
from jaxmp._src.float8.scaling import scale_for
from jaxmp._src.float8.table import DEFAULT_RECIPE
from jaxmp._src.float8.table import RECIPES
from jaxmp._src.float8.table import check_scaling
from jaxmp._src.float8.table import recipe_for
from jaxmp._src.float8.table import recipe_on
from jaxmp._src.float8.table import scaled_product
from jaxmp._src.float8.target import Target
from jaxmp._src.float8.target import block_scaled_gemms
from jaxmp._src.float8.target import describe

__all__ = [
    "COSTLY", "DEFAULT_RECIPE", "FLOAT8_PRIMITIVES", "Float8Rules", "NVFP4", "Product", "RECIPES",
    "Recipe", "Target", "block_scaled_gemms", "check_matmul_dtype", "check_scaling",
    "conv_float8_products", "describe", "is_float8_dtype", "mx_quantize", "placement",
    "product_of", "recipe_for", "recipe_on", "scale_for", "scaled_product",
]
