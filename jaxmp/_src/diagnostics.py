"""Backend-independent measures of what mixed precision buys.

Time and peak memory depend on the machine. These two measures do not, so they
can be tracked on a CPU-only machine and still say what a GPU will see:

* :func:`saved_activation_bytes`: the bytes a function's VJP keeps for the
  backward pass (the activations), from ``jax.eval_shape``: nothing runs.
* :func:`matmul_flops` / :func:`half_matmul_flop_share` /
  :func:`float8_matmul_flop_share`: the FLOPs of every matrix product and
  convolution in the program lowered for a GPU, by dtype.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxmp._src import casting
from jaxmp._src import gpu_program
from jaxmp._src import host
from jaxmp._src import in_place
from jaxmp._src import jaxprs
from jaxmp._src import lowered_flops

PyTree = Any



def saved_activation_bytes(
    fn: Callable, *args: Any, argnums: int | Sequence[int] = 0, has_aux: bool = False, **kwargs: Any
) -> int:
    """Bytes that the VJP of ``fn`` keeps for the backward pass.

    Differentiates ``fn`` with respect to the floating-point leaves of
    ``args[argnums]`` under ``jax.eval_shape`` and sums the sizes of everything
    the resulting VJP closure holds (the residuals). Nothing is computed or
    allocated, so it is cheap even for large models, and it does not depend on
    the backend. Arguments may be ``jax.ShapeDtypeStruct``, and any pytree:
    leaves that are not arrays (an Equinox module's functions, ``None``,
    strings) are closed over, and those ``fn`` returns are dropped.

    Args:
        fn: the function, typically a loss ``fn(params, batch) -> scalar``.
        *args: its positional arguments.
        argnums: which positional arguments are differentiated.
        has_aux: whether ``fn`` returns ``(output, aux)``.
        **kwargs: keyword arguments, not differentiated.

    Returns:
        The number of bytes, an ``int``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxmp
        >>> def loss(w, x):
        ...     return jnp.sum(jnp.tanh(x @ w))
        >>> w, x = jnp.ones((64, 64)), jnp.ones((128, 64))
        >>> full = jaxmp.debug.saved_activation_bytes(loss, w, x)
        >>> half = jaxmp.debug.saved_activation_bytes(jaxmp.cast_function(loss, jnp.float16), w, x)
        >>> full / half
        2.0
    """
    casting.check_function(fn, "jaxmp.debug.saved_activation_bytes",
                           "saved_activation_bytes(fn, *args, argnums=0, has_aux=False)")
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    # NNX modules as their state (in place), so that a module that is not a pytree counts too.
    fn, args, kwargs = in_place.functional(fn, args, kwargs, returns_state=False)

    def residuals(*call_args, **call_kwargs):
        diff, rebuild = jaxprs.at_positions(call_args, nums)

        def f(*floats):
            out = fn(*rebuild(floats), **call_kwargs)
            if not has_aux:
                return jaxprs.array_leaves(out)
            # Not a pair: jax.vjp says what has_aux=True expects.
            pair = isinstance(out, tuple) and len(out) == 2
            return (jaxprs.array_leaves(out[0]), out[1]) if pair else out

        out = jax.vjp(f, *diff, has_aux=has_aux)
        return out[1]

    shapes = jax.eval_shape(*jaxprs.over_arrays(residuals, args, kwargs, jaxprs.is_dynamic))
    return int(sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize
                   for s in jax.tree_util.tree_leaves(shapes)))


def _unplaced(tree: PyTree) -> PyTree:
    """``tree`` with its concrete arrays as shapes and dtypes, without their devices.

    The FLOPs do not depend on where the values are, and the devices of a
    ``pmap``'s outputs (a mesh of JAX's own) clash with those of the ``pmap``
    itself in a ``jit`` around it ("mesh should be the same across the entire
    program"). A ``jax.ShapeDtypeStruct`` keeps the sharding it was given.
    """
    return jax.tree_util.tree_map(
        lambda x: jaxprs.shape_dtype(x) if casting.is_array(x) else x, tree)


def matmul_flops(fn: Callable, *args: Any, platform: str = "cuda", target: Any = None,
                 **kwargs: Any) -> dict[str, int]:
    """FLOPs of the matrix products and convolutions of ``jax.jit(fn)``, by dtype.

    Without ``target``, this counts the program jaxmp and JAX build, before XLA
    optimises it: what the step *asks* the compiler for. With ``target="h100"``
    (or ``"b200"``) it counts the optimized program XLA's GPU compiler makes for
    that GPU (:func:`jaxmp.debug.gpu_program`: compiled here, no GPU needed, JAX's CUDA
    plugin needed): what the GPU *runs*. The two differ where XLA widens float8
    operands before a product (the convolutions it cannot run in float8, the
    block-scaled dots of a GPU without them) or runs a product without tensor
    cores; such a product counts under the dtype it runs in (``"float32"`` for
    one in a loop fusion). Compiling takes seconds to minutes.

    ``fn`` is traced with the given arguments and lowered to StableHLO for
    ``platform`` (no such device is needed: lowering for ``"cuda"`` works on a
    CPU-only machine). Each ``dot_general`` and ``convolution`` contributes
    ``2 * multiply-adds`` under the name of its operand dtype. Two different
    operand dtypes (a float32 cotangent times a bfloat16 activation) are
    converted to the product's result dtype by JAX's lowering for CPU and GPU,
    and count under it (``"mixed"`` with ``platform="tpu"``, which keeps
    them); a product of two different float8 formats
    (the backward products of ``autocast(..., matmul_dtype=...)``) is
    counted under both names joined by ``+``
    (``"float8_e4m3fn+float8_e5m2"``). The block-scaled dots of
    ``float8_scaling="mxfp8"`` (cuDNN custom calls in the CUDA program) count
    under their float8 operands' dtype. A function called several times (a
    nested ``jit``) counts once per call, and the body of a ``lax.scan`` (or
    of a ``fori_loop`` with fixed bounds) once per iteration, as
    :func:`jaxmp.debug.precision_report` counts them: a whole training run in one
    ``jit`` counts every step. The body of a loop whose trip count is not
    fixed when traced (``lax.while_loop``, unless it counts from 0 to a
    constant by 1) counts once.

    What a step does counts, not only what it returns: the Flax NNX modules
    and ``nnx.Optimizer`` among the arguments are traced as their state and
    their in-place updates as outputs (a step that updates them and returns
    nothing, or the loss alone, counts its backward pass and update too). A
    function whose every product is dead code (its results kept in a dict or
    an object it closes over) raises a ``ValueError`` that says to return them.

    Args:
        fn: any function, e.g. a whole training step.
        *args: its arguments (arrays, ``jax.ShapeDtypeStruct`` or any pytree;
            non-array leaves, such as the functions and static fields of an
            Equinox module, or ``None``, are closed over). ``fn`` may return
            any pytree too (a model updated by a training step): only its
            array leaves are kept. Arrays are read for their shapes and
            dtypes (the outputs of a ``pmap`` step can go back into it); a
            ``jax.ShapeDtypeStruct`` keeps its sharding.
        platform: the platform to lower for (without ``target``).
        target: ``None`` (the program before XLA), or a GPU target (``"h100"``,
            ``"b200"``, a :class:`jaxmp.debug.GpuTarget`): the optimized program for it.
        **kwargs: keyword arguments.

    Returns:
        A dict from dtype name (``"float16"``, ``"float32"``, ...) to FLOPs.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> a, b = jnp.ones((2, 3), jnp.float16), jnp.ones((3, 4), jnp.float16)
        >>> jaxmp.debug.matmul_flops(lambda a, b: a @ b, a, b)  # 2 * 2*3*4 multiply-adds
        {'float16': 48}
    """
    casting.check_function(fn, "jaxmp.debug.matmul_flops", "matmul_flops(fn, *args, **kwargs)")
    if target is not None:
        return gpu_program.gpu_program(fn, *args, target=target, **kwargs).matmul_flops()
    call, dynamic = in_place.array_function(fn, args, kwargs)  # in-place updates count
    with host.no_host_callbacks():  # host callbacks cannot be lowered for another platform
        traced = jax.jit(call).trace(_unplaced(dynamic))
        lowered = traced.lower(lowering_platforms=(platform,))
    totals = lowered_flops.module_flops(lowered.as_text())
    in_place.refuse_if_uncounted(traced.jaxpr, sum(totals.values()), "jaxmp.debug.matmul_flops")
    return totals


def half_matmul_flop_share(fn: Callable, *args: Any, platform: str = "cuda", target: Any = None,
                           **kwargs: Any) -> float:
    """The share of :func:`matmul_flops` in low precision: float16, bfloat16 or float8 operands.

    A product counts when both operands are float16, both bfloat16, or both
    float8 (of one or two float8 formats); :func:`float8_matmul_flop_share`
    counts the float8 ones alone. Returns ``0.0`` for a function with no
    matrix products. ``target="h100"`` counts what that GPU runs instead of
    what the step asks for (see :func:`matmul_flops`).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> def f(w, x):
        ...     return jnp.sum(x @ w)
        >>> w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
        >>> jaxmp.debug.half_matmul_flop_share(f, w, x)
        0.0
        >>> jaxmp.debug.half_matmul_flop_share(jaxmp.cast_function(f, jnp.float16), w, x)
        1.0
    """
    return lowered_flops.low_precision_share(matmul_flops(fn, *args, platform=platform, target=target, **kwargs))


def float8_matmul_flop_share(fn: Callable, *args: Any, platform: str = "cuda", target: Any = None,
                             **kwargs: Any) -> float:
    """The share of :func:`matmul_flops` whose operands are both float8 (any float8 formats).

    Returns ``0.0`` for a function with no matrix products. Without
    ``target`` this is the share jaxmp *asks* XLA for; with ``target="h100"``
    (or ``"b200"``) the share that GPU runs on float8 tensor cores
    (:func:`jaxmp.debug.gpu_program`), which can be lower: XLA widens the float8
    operands of some products before running them.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> def f(w, x):
        ...     return jnp.sum(x @ w)
        >>> w, x = jnp.ones((32, 32)), jnp.ones((16, 32))
        >>> jaxmp.debug.float8_matmul_flop_share(jaxmp.autocast(f, jnp.bfloat16), w, x)
        0.0
        >>> jaxmp.debug.float8_matmul_flop_share(
        ...     jaxmp.autocast(f, jnp.bfloat16, matmul_dtype=jnp.float8_e4m3fn), w, x)
        1.0
    """
    return lowered_flops.float8_share(matmul_flops(fn, *args, platform=platform, target=target, **kwargs))
