"""Which matrix products of a float8 step run wider than float8, and why: said once.

With a float8 ``matmul_dtype``, :func:`warn_if_float8_shortfall` places each
product of the function autocast traces as autocast places it (forward and
backward products), counts the share of the FLOPs that run in float8, and says
which products cannot run in float8 for a reason of autocast's (a
:class:`Float8ShortfallWarning`), naming the first by the user's file and line
and saying why (:data:`WIDER`). With a block-scaled recipe (``"mxfp8"``) it
also says the FLOPs that padding to whole blocks adds, the products that run
with one scale per tensor, and when the GPU the step is traced for runs the
recipe's fallback instead.

The products and which of their operands are differentiated are counted by
:mod:`jaxmp._src.census`; each warning is said once per place
(:func:`messages.warn_once`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from jaxmp._src import casting
from jaxmp._src import census
from jaxmp._src import compat
from jaxmp._src import float8
from jaxmp._src import jaxprs
from jaxmp._src import messages
from jaxmp._src import source


class Float8ShortfallWarning(UserWarning):
    """Says that some matrix products of a step with a float8 ``matmul_dtype`` run wider.

    Issued while :func:`jaxmp.autocast` (so also :func:`jaxmp.mp_value_and_grad`
    and friends) traces a function with ``matmul_dtype=jnp.float8_e4m3fn`` (or
    ``float8_e5m2``), when a matrix product or convolution, or its backward
    products, cannot run in float8 for a reason other than the user's own
    :class:`jaxmp.experimental.Float8Rules`: an operand that is not floating point, a product
    inside a function with its own derivative rule (``jax.custom_vjp``,
    ``jax.custom_jvp``: autocast runs the rule as written), a product the
    autocast rules leave out of ``low_precision``. The message gives the share
    of the FLOPs that run in float8 (forward and backward products, as autocast
    places them), the first such product by the user's file and line, and why.
    A product that ``Float8Rules`` keeps in the compute dtype is never
    reported. With ``float8_scaling="mxfp8"`` it also says how many FLOPs the
    zero padding of contracting dimensions that are not a multiple of 32 adds
    (forward and backward products), and which products (convolutions) run
    with one scale per tensor instead, or, when the GPU the step is traced for
    has no block-scaled GEMMs (Hopper and older), that the per-tensor recipe
    runs there instead, naming the GPU and its generation. A convolution's
    kernel gradient (and a strided convolution's input gradient) runs in the
    compute dtype, since XLA's GPU compiler runs only forward convolutions in
    float8: that is said too. Said once per such product: tracing again does
    not repeat it.

    Examples:
        >>> import warnings
        >>> import jax, jax.numpy as jnp
        >>> import jaxmp
        >>> @jax.custom_vjp  # a product with its own backward rule, run as written
        ... def project(x, w):
        ...     return x @ w
        >>> project.defvjp(lambda x, w: (x @ w, (x, w)),
        ...                lambda res, g: (g @ res[1].T, res[0].T @ g))
        >>> def loss_fn(w, x):
        ...     return jnp.mean(project(x, w) ** 2)
        >>> f8 = jaxmp.autocast(loss_fn, jnp.bfloat16, matmul_dtype=jnp.float8_e4m3fn)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = jax.grad(f8)(jnp.ones((16, 16)), jnp.ones((8, 16)))
        >>> caught[0].category is jaxmp.experimental.Float8ShortfallWarning
        True
        >>> "custom_vjp" in str(caught[0].message)
        True
    """


class Float8PlacementWarning(UserWarning):
    """Says which matrix products a float8 step keeps in the compute dtype, since float8 does
    not pay for them.

    Issued once while :func:`jaxmp.autocast` traces a function with a float8
    ``matmul_dtype``, when it keeps products of a kind float8 costs more than
    it saves for on the GPU (:class:`jaxmp.experimental.Float8Rules`: an
    attention's ``q @ k.T`` and ``probs @ v``, convolutions), with their share
    of the FLOPs and where the first of each kind is. These are no shortfall:
    ``Float8Rules(include={"attention"})`` asks for them in float8.

    Examples:
        >>> import warnings
        >>> import jax, jax.numpy as jnp
        >>> import jaxmp
        >>> def attend(q, k):  # q @ k.T of two activations: kept in bfloat16
        ...     return jnp.einsum("bqd,bkd->bqk", jnp.tanh(q), jnp.tanh(k)).sum()
        >>> f8 = jaxmp.autocast(attend, jnp.bfloat16, matmul_dtype=jnp.float8_e4m3fn)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = jax.grad(f8)(jnp.ones((2, 8, 16)), jnp.ones((2, 8, 16)))
        >>> caught[0].category is jaxmp.experimental.Float8PlacementWarning
        True
        >>> "include={'attention'}" in str(caught[0].message)
        True
    """


class Why(NamedTuple):
    """One reason a product runs wider than asked: what to say, and the fix.

    Both are ``str.format`` templates (fields ``primitive``, ``dtypes``,
    ``compute``, ``rule``; :func:`jaxmp.debug.precision_report` adds ``origin``).
    The rows of :data:`WIDER` are the float8 warning's; the precision report
    writes its own reasons in the same form.
    """

    says: str
    fix: str


#: Why a product (or its backward products) runs wider than float8, by reason: the float8
#: warning's words, which :func:`jaxmp.debug.precision_report` also uses for these reasons.
WIDER = {
    "rules": Why(
        "{primitive} is not in the autocast rules' low_precision set, so autocast does not "
        "run it in float8 (its operands are {dtypes})",
        "put it back in jaxmp.AutocastRules.low_precision"),
    "operand": Why(
        "its operands are {dtypes}: a float8 product needs two floating-point operands, so "
        "it runs in {compute}",
        "convert that operand to a floating-point dtype in your code"),
    "float8_operand": Why(
        "your code gives it one float8 operand ({dtypes}); autocast runs a product with a "
        "float8 operand as written",
        "give it both operands in float8, or neither"),
    "custom_rule": Why(
        "it is inside a function with its own derivative rule ({rule}), which autocast runs "
        "as written: its backward products run on {dtypes} operands",
        "write that function without a custom derivative rule"),
    "transposed_conv": Why(
        "it dilates its input (lhs_dilation: a transposed convolution), which XLA's GPU "
        "compiler runs as a cuDNN backward-data call, and those take no float8 operands "
        "(XLA would widen them to float32), so autocast runs it in {compute}",
        "none in your code: cuDNN runs it in the compute dtype"),
    "conv_backward": Why(
        "XLA's GPU compiler gives cuDNN float8 graphs to forward convolutions only and widens "
        "the float8 operands of backward-filter and backward-data calls to float32, so "
        "autocast runs a convolution's kernel gradient (and a strided convolution's input "
        "gradient) in {compute}, cuDNN's own kernels for them, and the rest in float8",
        "none in your code: cuDNN runs those backward products fastest in the compute "
        "dtype"),
}


class _Placed(NamedTuple):
    """Where autocast runs one product: float8 forward / backward, or why not."""

    forward: bool  # the product itself in float8
    backward: bool  # its backward products in float8
    why: str | None  # a key of ``WIDER``; None: float8, or kept by the user's Float8Rules


def _place(eqn, enclosing: tuple, rules: Any, float8_rules: Any,
           from_inputs: dict | None = None) -> _Placed:
    """Where autocast runs the product ``eqn`` under a float8 ``matmul_dtype``.

    Autocast's own decision (:func:`float8.placement`, with which operands are
    read from the inputs: ``from_inputs``, :func:`jaxprs.read_from_inputs`),
    plus what the census sees and autocast does not decide: a product inside a
    function with its own derivative rule runs its backward as that rule is
    written. A product float8 does not pay for (``float8.COSTLY``) is placed in
    the compute dtype like one the user's rules keep: no shortfall.
    """
    scopes = [compat.name_stack(e) for e in (*enclosing, eqn)]
    why = float8.placement(eqn, "/".join(s for s in scopes if s), rules.low_precision,
                           float8_rules, (from_inputs or {}).get(id(eqn), (True, True)))
    if why == "float8_operand":  # written in float8 by the user: fine if both operands are
        floats = [v.aval.dtype for v in eqn.invars[:2] if casting.is_float_dtype(v.aval.dtype)]
        both = len(floats) == 2 and all(float8.is_float8_dtype(d) for d in floats)
        return _Placed(both, both, None if both else why)
    if why == "kept" or why in float8.COSTLY:
        return _Placed(False, False, None)  # the user's Float8Rules keep it, or its cost
    if why is not None:
        return _Placed(False, False, why)
    if any(e.primitive.name in compat.CUSTOM_RULES for e in enclosing):
        return _Placed(True, False, "custom_rule")
    if eqn.primitive.name == "conv_general_dilated" and not all(_float8_gradients(eqn, True)):
        return _Placed(True, True, "conv_backward")
    return _Placed(True, True, None)


def _float8_gradients(eqn, backward: bool) -> tuple[bool, bool]:
    """Whether the gradients with respect to ``eqn``'s left and right operands run in float8,
    for a product whose backward products autocast places in float8 (``backward``): both for
    a ``dot_general``; for a convolution, what XLA runs in float8
    (:func:`float8.conv_float8_products`: the input gradient with unit strides, never the
    kernel gradient)."""
    if not backward:
        return False, False
    if eqn.primitive.name == "conv_general_dilated":
        return float8.conv_float8_products(compat.conv_params(eqn))[1:]
    return True, True


def _contracted(eqn) -> list[tuple[str, int]]:
    """``(product, elements contracted)`` of a ``dot_general`` and of its two backward products.

    The forward product contracts the contracting dimensions; the input
    gradient (``ct . rhs``) the rhs's free dimensions; the weight gradient
    (``lhs . ct``) the lhs's free dimensions (a layer's batch and tokens).
    """
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    (lc, rc), (lb, rb) = compat.dimension_numbers(eqn)
    free = lambda shape, c, b: math.prod(n for d, n in enumerate(shape) if d not in c and d not in b)
    return [("forward", math.prod(lhs[d] for d in lc)),
            ("input-gradient", free(rhs, rc, rb)),
            ("weight-gradient", free(lhs, lc, lb))]


def _differentiated_operands(eqn, diff: dict) -> tuple[bool, bool]:
    """Whether the program computes the gradient of each operand of the product ``eqn``: the
    operand is floating point and differentiated (``diff``,
    :func:`census.differentiated_products`)."""
    marked = diff.get(id(eqn), (True, True))
    return tuple(d and casting.is_float_dtype(v.aval.dtype)
                 for v, d in zip(eqn.invars[:2], marked))


def _phases(eqn, diff: dict, placed: _Placed) -> list[str]:
    """The products of ``eqn`` the program computes, by :func:`_contracted`'s names: the
    forward one, and the gradient of each differentiated operand (when float8)."""
    lhs, rhs = _differentiated_operands(eqn, diff)
    float8_lhs, float8_rhs = _float8_gradients(eqn, placed.backward)
    return ["forward"] + [name for name, d in (("input-gradient", lhs and float8_lhs),
                                               ("weight-gradient", rhs and float8_rhs)) if d]


def _warn_if_unblocked(closed_jaxpr, rules: Any, float8_rules: Any, recipe: Any,
                       diff: dict, from_inputs: dict) -> bool:
    """Warns when products of a block-scaled ``recipe`` are padded or run with one scale per tensor.

    A contracting dimension that is not a multiple of ``recipe.block`` is
    padded with zeros (FLOPs spent on zeros); a primitive the recipe does not
    block-scale (a convolution under ``"mxfp8"``) runs with one scale per
    tensor. Says the extra FLOPs or the share, and the first such product.
    The products counted are those the program computes (``diff``, from
    :func:`census.differentiated_products`): the share is the one
    :func:`jaxmp.debug.matmul_flops` gives, with and without ``"mxfp8"``.
    """
    total = padding = per_tensor = 0
    first_padded = first_tensor = None
    for eqn, flops, enclosing in census.census(closed_jaxpr.jaxpr):
        placed = _place(eqn, enclosing, rules, float8_rules, from_inputs)
        if not placed.forward or any(
                float8.is_float8_dtype(v.aval.dtype) for v in eqn.invars[:2]):
            continue  # not a product autocast scales (a float8 product written as such)
        phases = _phases(eqn, diff, placed)
        total += flops * len(phases)
        if eqn.primitive.name not in recipe.blocked:
            per_tensor += flops * len(phases)
            first_tensor = first_tensor or (eqn, enclosing)
            continue
        for phase, k in _contracted(eqn):
            if phase not in phases:
                continue
            if k % recipe.block:
                padding += flops * (-(-k // recipe.block) * recipe.block - k) // k
                first_padded = first_padded or (eqn, enclosing, phase, k)
    warned = False
    if first_tensor is not None:
        eqn, enclosing = first_tensor
        warned |= messages.warn_once(
            (source.location_key(eqn, enclosing), "per_tensor", recipe.name),
            f"jaxmp: autocast with float8_scaling={recipe.name!r} runs "
            f"{messages.percent(per_tensor / total)} of the float8 matrix-product FLOPs of this "
            f"function with one scale per tensor instead: {recipe.name} scales "
            f"{' and '.join(sorted(recipe.blocked))} in blocks, and the first other product is a "
            f"{eqn.primitive.name} at {source.user_location(eqn, enclosing)}.\n"
            "  Fix: none needed where one scale per tensor suits them; to keep them in the "
            "compute dtype instead (which silences this), "
            "jaxmp.experimental.Float8Rules(primitives={'dot_general'}).",
            Float8ShortfallWarning)
    if first_padded is not None:
        eqn, enclosing, phase, k = first_padded
        padded = -(-k // recipe.block) * recipe.block
        warned |= messages.warn_once(
            (source.location_key(eqn, enclosing), "padding", recipe.name),
            f"jaxmp: autocast with float8_scaling={recipe.name!r} pads contracting dimensions "
            f"that are not a multiple of {recipe.block} with zeros: "
            f"{messages.percent(padding / total, 1)} more float8 matrix-product FLOPs for the "
            "same result (forward products, and the backward products of differentiated "
            f"operands: jaxmp.debug.matmul_flops of this step with float8_scaling={recipe.name!r}"
            f" over that with 'tensor'). The first is a {eqn.primitive.name} at "
            f"{source.user_location(eqn, enclosing)}: its {phase} product contracts {k} "
            f"elements, padded to {padded}.\n"
            f"  Fix: make that dimension a multiple of {recipe.block} (a head size, a width, "
            "batch x sequence length for the weight gradient); or keep the product in the "
            "compute dtype with jaxmp.experimental.Float8Rules (keep_scopes=, keep_if=, min_flops=), or "
            "use float8_scaling='tensor'.",
            Float8ShortfallWarning)
    return warned


def _warn_if_fallback(closed_jaxpr, rules: Any, float8_rules: Any, recipe: Any,
                      from_inputs: dict) -> bool:
    """Warns when a block-scaled ``recipe`` runs its fallback: the target (from the first
    product autocast scales, :func:`float8.recipe_for`) has no block-scaled GEMMs."""
    if recipe.fallback is None:
        return False
    for eqn, _, enclosing in census.census(closed_jaxpr.jaxpr):
        if eqn.primitive.name not in recipe.blocked or not _place(
                eqn, enclosing, rules, float8_rules, from_inputs).forward:
            continue
        runs, target = float8.recipe_for(recipe, [v.aval for v in eqn.invars])
        if runs is recipe:
            return False
        return messages.warn_once(
            ("fallback", recipe.name, target),
            f"jaxmp: autocast with float8_scaling={recipe.name!r} needs block-scaled GEMMs, "
            f"which NVIDIA GPUs have from compute capability 10.0 (Blackwell); this program is "
            f"traced for {float8.describe(target)}, where XLA would expand cuDNN's "
            "block-scaled dot into float32 products without tensor cores. So autocast runs "
            f"the {runs.name!r} recipe there instead ({runs.summary}): float8 GEMMs this "
            f"hardware has. The first product is a {eqn.primitive.name} at "
            f"{source.user_location(eqn, enclosing)}.\n"
            f"  Fix: none needed on this device; float8_scaling={runs.name!r} (with "
            f"matmul_dtype=jnp.{runs.matmul_dtypes[0].name}) runs the same program without this "
            "warning.",
            Float8ShortfallWarning)
    return False


def _warn_if_recipe_keeps(closed_jaxpr, rules: Any, float8_rules: Any, recipe: Any,
                          from_inputs: dict) -> bool:
    """Says once which products a recipe's own rules (``recipe.rules``, used when autocast is
    given no ``float8_rules``: NVFP4 keeps its output head) keep in the compute dtype."""
    if recipe.rules is None or float8_rules is not recipe.rules:
        return False
    kept, total, first = 0, 0, None
    for eqn, flops, enclosing in census.census(closed_jaxpr.jaxpr):
        scope = "/".join(s for s in (compat.name_stack(e) for e in (*enclosing, eqn)) if s)
        total += flops
        if float8.placement(eqn, scope, rules.low_precision, float8_rules,
                            from_inputs.get(id(eqn), (True, True))) == "kept":
            kept += flops
            first = first or (eqn, enclosing)
    if first is None:
        return False
    eqn, enclosing = first
    return messages.warn_once(
        (source.location_key(eqn, enclosing), "recipe_keeps", recipe.name),
        f"jaxmp: autocast with float8_scaling={recipe.name!r} keeps "
        f"{messages.percent(kept / total)} of the forward matrix-product FLOPs of this function "
        f"in the compute dtype, by the recipe's own rules ({recipe.rules!r}); the first is a "
        f"{eqn.primitive.name} at "
        f"{source.user_location(eqn, enclosing)}.\n"
        "  Fix: none needed; to choose other products, pass "
        "float8_rules=jaxmp.experimental.Float8Rules(...) (jaxmp.experimental.Float8Rules() "
        "keeps none).",
        Float8ShortfallWarning)


def _say_kept_by_cost(closed_jaxpr, rules: Any, float8_rules: Any, compute_dtype: Any,
                      matmul_dtype: Any, diff: dict, from_inputs: dict) -> bool:
    """Says, once, which products autocast keeps in the compute dtype because float8 does not
    pay for them (``float8.COSTLY``), their share of the FLOPs, the first of each kind by the
    user's file and line, and how to ask for them in float8 (``Float8Rules(include=...)``)."""
    total = 0
    kept: dict = {}  # kind -> [products, FLOPs, first (eqn, enclosing)]
    for eqn, flops, enclosing in census.census(closed_jaxpr.jaxpr):
        flops *= 1 + sum(_differentiated_operands(eqn, diff))
        total += flops
        scopes = [compat.name_stack(e) for e in (*enclosing, eqn)]
        why = float8.placement(eqn, "/".join(s for s in scopes if s), rules.low_precision,
                               float8_rules, from_inputs.get(id(eqn), (True, True)))
        if why in float8.COSTLY:
            row = kept.setdefault(why, [0, 0, (eqn, enclosing)])
            row[0] += 1
            row[1] += flops
    if not kept:
        return False
    lines = [f"  - {n} {kind} product{'s' * (n > 1)} ({messages.percent(f / total)} of the "
             f"FLOPs), the first at {source.user_location(*first)}: {float8.COSTLY[kind].says}"
             for kind, (n, f, first) in kept.items()]
    first = next(iter(kept.values()))[2]
    return messages.warn_once(
        (source.location_key(*first), "costly", tuple(sorted(kept))),
        f"jaxmp: autocast with matmul_dtype={np.dtype(matmul_dtype).name} keeps these "
        f"products in {np.dtype(compute_dtype).name}, where float8 costs more than it saves "
        "on the GPU (the program XLA compiles for an H100):\n" + "\n".join(lines) + "\n"
        "  Fix: none needed; to run them in float8 anyway, float8_rules="
        "jaxmp.experimental.Float8Rules(include={"
        + ", ".join(map(repr, sorted(kept))) + "}).",
        Float8PlacementWarning)


def warn_if_float8_shortfall(closed_jaxpr, rules: Any, float8_rules: Any, compute_dtype: Any,
                             matmul_dtype: Any, recipe: Any = None,
                             differentiated: list | None = None,
                             from_inputs: dict | None = None) -> bool:
    """Warns when products of ``closed_jaxpr`` run wider than float8 for a reason of autocast's.

    ``closed_jaxpr`` is the function autocast traced, with ``rules`` (a
    :class:`jaxmp.AutocastRules`), ``float8_rules`` and the dtypes autocast
    runs it with. Each product is placed as autocast places it; its backward
    products (one per floating-point operand, as many FLOPs each) run in
    float8 when the product does, except inside a function with its own
    derivative rule, which autocast runs as written. Products that
    ``float8_rules`` keeps are counted in the share but never reported.
    With a block-scaled ``recipe`` (a row of ``float8.RECIPES``, ``"mxfp8"``),
    also warns when products are padded to whole blocks or run with one
    scale per tensor (:func:`_warn_if_unblocked`), or when the target has no
    block-scaled GEMMs and the recipe's fallback runs instead
    (:func:`_warn_if_fallback`). ``differentiated`` says
    which inputs of ``closed_jaxpr`` are being differentiated
    (:func:`census.is_differentiated` of each; ``None``: all): a backward product is
    counted only for an operand that depends on one, as the program computes
    it. Returns whether it warned; said once per first product
    (:func:`messages.warn_once`).
    """
    if differentiated is None:
        differentiated = [True] * len(closed_jaxpr.jaxpr.invars)
    diff = census.differentiated_products(closed_jaxpr.jaxpr, differentiated)
    if from_inputs is None:
        from_inputs = jaxprs.read_from_inputs(closed_jaxpr.jaxpr)
    if recipe is not None:
        _warn_if_recipe_keeps(closed_jaxpr, rules, float8_rules, recipe, from_inputs)
    fallback = recipe is not None and _warn_if_fallback(closed_jaxpr, rules, float8_rules,
                                                        recipe, from_inputs)
    unblocked = fallback or (recipe is not None and recipe.block > 0 and _warn_if_unblocked(
        closed_jaxpr, rules, float8_rules, recipe, diff, from_inputs))
    unblocked |= _say_kept_by_cost(closed_jaxpr, rules, float8_rules, compute_dtype,
                                   matmul_dtype, diff, from_inputs)
    total = in_float8 = wider = 0
    first = None
    for eqn, flops, enclosing in census.census(closed_jaxpr.jaxpr):
        placed = _place(eqn, enclosing, rules, float8_rules, from_inputs)
        grads = _differentiated_operands(eqn, diff)
        backward = flops * sum(grads)
        backward8 = flops * sum(g and f for g, f in zip(grads, _float8_gradients(
            eqn, placed.backward)))
        total += flops + backward
        in_float8 += flops * placed.forward + backward8
        if placed.why is not None:
            here = flops * (not placed.forward) + backward - backward8
            wider += here
            # a convolution says why its kernel gradient runs wider only when it computes one
            if first is None and (here or placed.why != "conv_backward"):
                first = (eqn, enclosing, placed.why)
    if first is None:
        return unblocked
    eqn, enclosing, why = first
    custom = next((e for e in reversed(enclosing) if e.primitive.name in compat.CUSTOM_RULES), None)
    says = WIDER[why].says.format(
        primitive=eqn.primitive.name,
        dtypes=" x ".join(np.dtype(v.aval.dtype).name for v in eqn.invars[:2]),
        compute=np.dtype(compute_dtype).name,
        rule=compat.CUSTOM_RULES.get(custom.primitive.name, "") if custom is not None else "")
    return unblocked | messages.warn_once(
        (source.location_key(eqn, enclosing), why),
        f"jaxmp: autocast with matmul_dtype={np.dtype(matmul_dtype).name} runs "
        f"{messages.percent(in_float8 / total)} of the matrix-product FLOPs of this function "
        f"in float8 (forward and backward products); {messages.percent(wider / total)} run "
        f"wider for reasons other than your jaxmp.experimental.Float8Rules. The first is a "
        f"{eqn.primitive.name} at {source.user_location(eqn, enclosing)}: {says}.\n"
        f"  Fix: {WIDER[why].fix}; or keep such products in the compute dtype on purpose "
        "with jaxmp.experimental.Float8Rules (keep_scopes=, keep_if=, min_flops=), which also silences "
        "this warning.",
        Float8ShortfallWarning,
    )
