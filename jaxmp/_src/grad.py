"""Mixed-precision gradients with loss scaling: ``mp_value_and_grad`` and ``mp_grad``."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jaxmp._src import kernel
from jaxmp._src import sharding


def mp_value_and_grad(
    fn: Callable,
    *,
    argnums: int | Sequence[int] = 0,
    no_cast_argnums: int | Sequence[int] = (),
    has_aux: bool = False,
    compute_dtype: Any = jnp.bfloat16,
    use_mixed_precision: bool = True,
    axis_name: Any = None,
    autocast: bool = True,
    reduce_dtype: Any = None,
    matmul_dtype: Any = None,
    float8_scaling: str = "tensor",
    autocast_rules: Any = None,
    float8_rules: Any = None,
) -> Callable:
    """Like ``jax.value_and_grad``, in mixed precision with loss scaling.

    The returned function takes the arguments of ``fn`` plus a keyword-only
    ``scaler_state`` and, on each call:

    1. runs ``fn`` under :func:`jaxmp.autocast` (the default): matrix products
       and convolutions in ``compute_dtype``, sums, normalisations, softmax and
       exp/log in float32, whatever dtypes the model's layers or the values
       the loss makes itself (a batch in a closure, noise drawn inside) have.
       Every half-precision floating leaf of the arguments is handed to ``fn``
       as an exact float32 view, so the user's code sees one dtype (a
       bfloat16 weight meets float32 noise in a convolution that JAX would
       refuse otherwise) while autocast runs the products in
       ``compute_dtype``.
       With ``autocast=False`` it instead casts the floating-point leaves of
       all arguments to ``compute_dtype`` (integer arrays, keys and non-array
       leaves are left alone) and runs ``fn`` as written; if less than half of
       the matrix-product FLOPs then have half-precision operands, a
       :class:`jaxmp.debug.MostlyFloat32Warning` says so once, while tracing;
    2. converts the loss to float32 and only then multiplies it by the scale,
       so the scaled loss cannot overflow float16;
    3. differentiates the scaled loss with respect to the floating-point leaves
       of the arguments in ``argnums``; gradients come back in the dtype of the
       original leaves (float32 for float32 parameters) and are divided by the
       scale used in this backward pass; non-floating leaves get ``None``, as
       with ``equinox.filter_grad``;
    4. checks that every gradient is finite and adjusts the scaler.

    The returned loss is the loss ``fn`` computed, converted to float32 and
    never multiplied by the scale. It is not a float32 recomputation: under
    autocast the loss's sums run in float32; a loss whose last operations run
    in float16 (``autocast=False``) comes back as that float16 value, widened.
    Such a loss also caps the loss scale at ``2**15``: the gradient of a
    float16 loss with respect to itself is the scale, in float16, and from
    ``2**16`` on it is ``inf``. Floating-point aux leaves come back in float32,
    except framework state returned updated: a subtree of ``aux`` with the
    tree structure and leaf shapes of an argument that is not differentiated
    (Haiku's state, Flax's ``batch_stats``, an Equinox ``State``; those in
    ``no_cast_argnums`` first) comes back in that argument's dtypes. State
    carried between steps keeps its dtype, whatever batch it was initialised
    with and whatever dtype it was cast to.

    With ``use_mixed_precision=False`` the inputs are cast to float32, nothing
    is scaled and ``scaler_state`` is returned unchanged, with the same output
    structure: a training loop switches precision with one flag.

    Args:
        fn: the loss function; returns a scalar, or ``(loss, aux)`` with
            ``has_aux=True``.
        argnums: which positional arguments to differentiate, as in
            ``jax.value_and_grad``.
        no_cast_argnums: positional arguments never narrowed to the compute
            dtype: framework state that must keep its precision, such as
            Haiku's ``transform_with_state`` state or Flax's ``batch_stats``
            (under autocast, their half-precision leaves are float32 views
            like every input's). The state the loss returns updated in its
            aux comes back in their dtypes. They cannot overlap ``argnums``.
        has_aux: whether ``fn`` returns ``(loss, aux)``.
        compute_dtype: ``jnp.bfloat16`` (default, as everywhere in jaxmp:
            float32's range, so no loss scaling is needed),
            ``jnp.float16`` (with a dynamic loss scale:
            ``jaxmp.scaler_for(jnp.float16)``) or ``jnp.float32``.
        use_mixed_precision: ``False`` runs in float32 without scaling.
        axis_name: inside ``shard_map``/``pmap``, the data-parallel axis
            name(s): those the batch is split over. The loss and the gradients
            are then those of the mean of the per-device losses, for
            parameters replicated over these axes and for parameters sharded
            over them and gathered in the forward pass (FSDP, read from
            ``shard_map``'s ``check_vma`` types); each device gets its shard's
            gradient. Required inside ``shard_map`` (``None`` raises there);
            ``()`` gives per-device gradients. Leave it ``None`` under ``jit``
            with ``NamedSharding``. Whatever it lists, ``finite`` and the new
            scaler state are the same on every device of the mesh.
        autocast: ``True`` (default) applies :func:`jaxmp.autocast` to
            ``fn`` (per-operation precision); ``False`` casts the inputs and
            runs ``fn`` as written (what MPX and jmp do).
        reduce_dtype: the dtype of gradient sums over devices. ``None``
            (default): jaxmp's own sums over ``axis_name`` (unscaled
            gradients) run in float32 (float64 for float64 leaves), and the
            sums that XLA inserts under ``jit`` or autodiff inserts for an
            ``all_gather`` (FSDP) stay in the compute dtype, on scaled values.
            ``jnp.float32``: all of them in float32 (matrix products then give
            their gradients in float32 before the cast back; twice the
            traffic of float16). ``jnp.bfloat16``/``jnp.float16``: jaxmp's
            own sums in that dtype too, halving their traffic. Gradient sums
            only: the forward ``psum`` of partial products under tensor
            parallelism runs in the compute dtype (``docs/multi_device.md``
            shows how to run it in float32).
        matmul_dtype: with ``autocast=True``, ``jnp.float8_e4m3fn`` runs the
            matrix products in float8 (``jaxmp.autocast``'s ``matmul_dtype``);
            ``None`` (default): in ``compute_dtype``.
        float8_scaling: how those float8 products are scaled
            (``jaxmp.autocast``'s ``float8_scaling``): ``"tensor"`` (default),
            one scale per tensor; ``"mxfp8"``, one power-of-two scale per block
            of 32 elements along each product's contracting dimension (OCP
            MXFP8, ``matmul_dtype=jnp.float8_e4m3fn``); ``"nvfp4"`` (or a
            :class:`jaxmp.experimental.NVFP4`), NVIDIA's 4-bit recipe
            (``matmul_dtype=jnp.float4_e2m1fn``); ``"delayed"``, one scale per
            tensor from an amax history of the last steps: the function then
            takes ``float8_state=`` (from
            :func:`jaxmp.experimental.init_float8_state`) and returns it updated
            as a fifth value (``docs/float8.md``, "Delayed scaling").
        autocast_rules: with ``autocast=True``, a :class:`jaxmp.AutocastRules`:
            which primitives autocast runs in which precision (``jaxmp.autocast``'s
            ``rules``), e.g. ``jaxmp.AutocastRules(full_precision=
            jaxmp.autocast.FULL_PRECISION | {"tanh"})`` to run ``tanh`` in
            float32. ``None`` (default): ``jaxmp.AutocastRules()``. With
            ``autocast=False`` it raises a ``ValueError``.
        float8_rules: with a float8 ``matmul_dtype``, a
            :class:`jaxmp.experimental.Float8Rules`: which matrix products run in
            float8 (``jaxmp.autocast``'s ``float8_rules``), e.g.
            ``Float8Rules(include={"convolution"})`` for the float8 convolutions
            kept in the compute dtype by default. ``None`` (default): the
            recipe's rules. Without ``matmul_dtype`` it raises a ``ValueError``.

    Returns:
        A function returning ``(loss, grads, scaler_state, finite)``, or
        ``((loss, aux), grads, scaler_state, finite)`` with ``has_aux=True``.
        ``grads`` is a tuple when ``argnums`` is a sequence. With
        ``float8_scaling="delayed"``, the updated ``float8_state`` follows ``finite``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxmp
        >>> def loss_fn(w, x):
        ...     return jnp.mean((x @ w) ** 2)
        >>> w, x = jnp.ones((3,)), jnp.ones((4, 3))
        >>> state = jaxmp.scaler_for(jnp.bfloat16)  # the default compute dtype: no scaling
        >>> loss, grads, state, finite = jaxmp.mp_value_and_grad(loss_fn)(
        ...     w, x, scaler_state=state)
        >>> float(loss), grads.dtype, bool(finite)
        (9.0, dtype('float32'), True)

        Matrix products in block-scaled float8 (MXFP8), forward and backward:

        >>> w, x = jnp.ones((64, 32)), jnp.ones((32, 64))  # dimensions: multiples of 32
        >>> loss, grads, state, finite = jax.jit(jaxmp.mp_value_and_grad(
        ...     loss_fn, compute_dtype=jnp.bfloat16, matmul_dtype=jnp.float8_e4m3fn,
        ...     float8_scaling="mxfp8"))(w, x, scaler_state=jaxmp.noop_scaler())
        >>> float(loss), float(grads[0, 0]), bool(finite)
        (4096.0, 4.0, True)
    """
    step = kernel.Step.create(
        fn, api="jaxmp.mp_value_and_grad", argnums=argnums, no_cast_argnums=no_cast_argnums,
        has_aux=has_aux, compute_dtype=compute_dtype, use_mixed_precision=use_mixed_precision,
        axis_name=axis_name, autocast=autocast,
        reduce_dtype=reduce_dtype, matmul_dtype=matmul_dtype, float8_scaling=float8_scaling,
        autocast_rules=autocast_rules, float8_rules=float8_rules)

    @kernel.wraps_adding_scaler_state(fn)
    def value_and_grad_fn(*args, scaler_state=kernel.REQUIRED, **kwargs):
        state = step.check_state(scaler_state)
        history, kwargs = step.split_float8_state(kwargs)  # float8_scaling="delayed" only
        diff, rebuild, devices = step.differentiable(args, state)

        def scaled_loss(d, h):
            return step.scaled_loss(state, rebuild(d), kwargs if h is None
                                    else {**kwargs, "float8_state": h})

        # The gradient of the float8 state holds what the step recorded (float8/delayed.py):
        # each device's own, joined by a maximum over the data axes (as one device's record of
        # the whole batch), not summed as the gradient of a replicated input would be.
        (_, (loss, aux)), (grads, recorded) = jax.value_and_grad(
            scaled_loss, argnums=(0, 1), has_aux=True)(
                step.traced_views(diff), sharding.recorded_per_device(history, devices))
        grads = step.unscale(state, grads, diff)
        out = step.finish(loss, aux, grads, state, devices)
        if history is None:
            return out
        recorded = sharding.max_over_devices(recorded, devices)
        return (*out, step.updated_float8_state(history, recorded))

    return value_and_grad_fn


def mp_grad(fn: Callable, **options: Any) -> Callable:
    """Like ``jax.grad``, in mixed precision with loss scaling.

    Takes the same options as :func:`mp_value_and_grad`.

    Returns:
        A function returning ``(grads, scaler_state, finite)``, or
        ``((grads, aux), scaler_state, finite)`` with ``has_aux=True`` (and the
        updated ``float8_state`` last with ``float8_scaling="delayed"``).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> grad_fn = jaxmp.mp_grad(lambda w: jnp.sum(w * w), compute_dtype=jnp.float16)
        >>> grads, state, finite = grad_fn(
        ...     jnp.ones(2), scaler_state=jaxmp.init_scaler(initial_scale=1024.0))
        >>> grads.tolist(), bool(finite)
        ([2.0, 2.0], True)
    """
    value_and_grad_fn = mp_value_and_grad(fn, **options)
    has_aux = options.get("has_aux", False)

    @kernel.wraps_adding_scaler_state(fn)
    def grad_fn(*args, scaler_state=kernel.REQUIRED, **kwargs):
        if scaler_state is kernel.REQUIRED:
            raise kernel.missing_scaler_state("jaxmp.mp_grad")
        value, grads, state, finite, *float8_state = value_and_grad_fn(
            *args, scaler_state=scaler_state, **kwargs)
        if has_aux:
            return ((grads, value[1]), state, finite, *float8_state)
        return (grads, state, finite, *float8_state)

    return grad_fn
