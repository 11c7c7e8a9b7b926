"""Gradient accumulation over micro-batches, with one loss scale per window.

:func:`accumulate_value_and_grad` splits the batch arguments of a loss function
into ``num_microbatches`` micro-batches and runs a ``lax.scan`` over them inside
the step. Each micro-batch is differentiated in the compute dtype with the
*same* loss scale; the scaled gradients are summed in float32; then, once per
effective batch, they are divided by the scale and by the number of
micro-batches, checked for inf/NaN and the scaler is adjusted. If any
micro-batch overflowed, the sum is not finite and the whole window is skipped
(by :func:`jaxmp.optimizer_update`) with a single back-off. Because the backward
pass of each micro-batch runs inside the scan body, the activations kept for
it are those of one micro-batch, not of the whole batch.

Composing with optax:

* ``optax.MultiSteps`` accumulates *across* calls instead of inside one: call
  :func:`jaxmp.mp_value_and_grad` each micro-step and hand the gradients to
  :func:`jaxmp.optimizer_update` with the ``MultiSteps`` optimizer. The
  gradients it receives are already unscaled, so a scale change in the middle
  of a window does not bias the mean; a micro-step that overflows is skipped
  entirely (``MultiSteps`` does not even count it), so the window still averages
  ``k`` finite micro-batches. The scaler, however, is adjusted once per
  micro-step. Both kinds of accumulation can be stacked: ``k`` micro-batches per
  call times ``m`` calls per ``MultiSteps`` window.
* ``optax.apply_if_finite`` is redundant with jaxmp's skip and weaker: after
  ``max_consecutive_errors`` non-finite updates in a row it *applies* them,
  which an overflow storm at the start of float16 training (a scale backing off
  from 2**15) easily reaches. Wrapped in :func:`jaxmp.optimizer_update`, the
  non-finite step is skipped before ``apply_if_finite`` sees it, so its
  counters stay at zero and it never gives up.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import casting
from jaxmp._src import kernel
from jaxmp._src import sharding

PyTree = Any


def _is_key(x: Any) -> bool:
    """A typed PRNG key array, or what a raw ``jax.random.PRNGKey`` looks like (uint32[2] or [4])."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return True
    return x.dtype == np.uint32 and np.ndim(x) == 1 and x.shape[0] in (2, 4)


class _Batch:
    """The batch arguments of one call, split into micro-batches along their leading axis.

    ``leaves`` holds, for every batch argument, its array leaves reshaped to
    ``(k, B // k, ...)`` (``None`` for leaves that are not split); ``rebuild``
    puts one micro-batch of them back into the full argument list. A PRNG key
    whose leading axis is not the batch axis (a single key, raw or typed) is not
    split: every micro-batch receives it unchanged.
    """

    def __init__(self, args: Sequence[Any], positions: Sequence[int], k: int):
        self.positions = positions
        flat = [jax.tree_util.tree_flatten_with_path(args[pos]) for pos in positions]
        arrays = [x for with_paths, _ in flat for _, x in with_paths if self._is_array(x)]
        sizes = {x.shape[0] for x in arrays if np.ndim(x) and not _is_key(x)}
        self.leaves, self.static = [], []
        for pos, (with_paths, treedef) in zip(positions, flat):
            split, static = [], []
            for path, x in with_paths:
                if self._is_array(x) and not (_is_key(x) and (np.ndim(x) == 0 or
                                                             x.shape[0] not in sizes)):
                    where = f"argument {pos}" + (
                        f" leaf {jax.tree_util.keystr(path)}" if path else "")
                    split.append(self._split(x, k, where))
                    static.append(None)
                else:
                    split.append(None)
                    static.append(x)
            self.leaves.append(split)
            self.static.append((treedef, static))

    @staticmethod
    def _is_array(x: Any) -> bool:
        return isinstance(x, (jax.Array, np.ndarray))

    @staticmethod
    def _split(x: Any, k: int, where: str) -> Any:
        if np.ndim(x) == 0 or x.shape[0] % k:
            shape = tuple(np.shape(x))
            raise ValueError(
                f"Every array in the batch arguments must have a leading batch axis "
                f"divisible by num_microbatches={k}; {where} has shape {shape}. If this "
                "argument is not part of the batch, leave it out of batch_argnums."
            )
        return x.reshape((k, x.shape[0] // k) + tuple(x.shape[1:]))

    def rebuild(self, args: Sequence[Any], micro_leaves: Sequence[Any]) -> list[Any]:
        full = list(args)
        for pos, leaves, (treedef, static) in zip(self.positions, micro_leaves, self.static):
            merged = [s if m is None else m for m, s in zip(leaves, static)]
            full[pos] = jax.tree_util.tree_unflatten(treedef, merged)
        return full


def accumulate_value_and_grad(
    fn: Callable,
    num_microbatches: int,
    *,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] | None = None,
    no_cast_argnums: int | Sequence[int] = (),
    has_aux: bool = False,
    compute_dtype: Any = jnp.bfloat16,
    use_mixed_precision: bool = True,
    axis_name: Any = None,
    autocast: bool = True,
    reduce_dtype: Any = None,
    matmul_dtype: Any = None,
    float8_scaling: str = "tensor",
) -> Callable:
    """Like :func:`jaxmp.mp_value_and_grad`, accumulated over micro-batches.

    The returned function is called like the one :func:`jaxmp.mp_value_and_grad`
    returns, ``(*args, scaler_state=state, **kwargs)``, with a full batch. Every
    array leaf of the positional arguments in ``batch_argnums`` (by default all
    positional arguments not in ``argnums``) is split along its leading axis
    into ``num_microbatches`` equal micro-batches; the other arguments and all
    keyword arguments are passed unchanged to every micro-batch.

    ``fn`` must return the *mean* loss of the batch it is given. The result is
    then exactly the full-batch computation: the loss is the mean of the
    micro-batch losses and the gradients are the mean of the micro-batch
    gradients, i.e. those of the full-batch mean loss. Inside, one loss scale is
    used for the whole window, the scaled gradients are summed in float32 (or
    float64 for float64 leaves), and unscaling, the finiteness check (reduced
    over ``axis_name``) and the scaler adjustment happen once, so one
    overflowing micro-batch skips the whole window and backs off once.

    Args:
        fn: the loss function, ``fn(*args, **kwargs) -> loss`` or
            ``(loss, aux)`` with ``has_aux=True``.
        num_microbatches: how many micro-batches the batch is split into (an
            int >= 1); the leading axis of every batch array must be divisible
            by it.
        argnums: which positional arguments to differentiate.
        batch_argnums: which positional arguments hold the batch. Defaults to
            every positional argument not in ``argnums`` or
            ``no_cast_argnums``. Non-array leaves of these arguments (Python
            numbers, ``None``) are not split, and neither is a single PRNG key
            (raw or typed): every micro-batch gets the same key. To vary a key
            per micro-batch, pass one key per example (e.g.
            ``jax.random.split(key, batch_size)``) as part of the batch.
        no_cast_argnums: as in :func:`jaxmp.mp_value_and_grad`: arguments
            passed whole to every micro-batch, never narrowed.
        has_aux: whether ``fn`` returns ``(loss, aux)``. The returned ``aux``
            stacks the micro-batch aux values along a new leading axis of size
            ``num_microbatches`` (floating leaves in float32 under mixed
            precision, except state of ``no_cast_argnums`` returned updated,
            in its own dtypes, as with :func:`jaxmp.mp_value_and_grad`).
        compute_dtype: ``jnp.bfloat16`` (default), ``jnp.float16`` or
            ``jnp.float32``.
        use_mixed_precision: ``False`` runs in float32 without scaling and
            returns ``scaler_state`` unchanged.
        axis_name: as in :func:`jaxmp.mp_value_and_grad`; the loss and
            gradients are averaged over devices once per window.
        autocast: as in :func:`jaxmp.mp_value_and_grad`.
        reduce_dtype: as in :func:`jaxmp.mp_value_and_grad`.
        matmul_dtype: as in :func:`jaxmp.mp_value_and_grad`.
        float8_scaling: as in :func:`jaxmp.mp_value_and_grad`: ``"tensor"``
            (default) or ``"mxfp8"`` (block-scaled float8 products, with
            ``matmul_dtype=jnp.float8_e4m3fn``).

    Returns:
        A function returning ``(loss, grads, scaler_state, finite)``, or
        ``((loss, aux), grads, scaler_state, finite)`` with ``has_aux=True``.

    Raises:
        ValueError: if ``num_microbatches`` is not an int >= 1, if
            ``batch_argnums`` overlaps ``argnums``, or (when called) if a batch
            array's leading axis is not divisible by ``num_microbatches``.
        TypeError: for the misuse :func:`jaxmp.mp_value_and_grad` rejects.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> def loss_fn(w, x, y):
        ...     return jnp.mean((x @ w - y) ** 2)
        >>> w, x, y = jnp.ones(3), jnp.ones((8, 3)), jnp.zeros(8)
        >>> step = jaxmp.accumulate_value_and_grad(loss_fn, num_microbatches=4,
        ...                                        compute_dtype=jnp.float16)
        >>> loss, grads, state, finite = step(
        ...     w, x, y, scaler_state=jaxmp.init_scaler(initial_scale=1024.0))
        >>> float(loss), grads.tolist(), bool(finite)
        (9.0, [6.0, 6.0, 6.0], True)
    """
    if (
        not isinstance(num_microbatches, (int, np.integer))
        or isinstance(num_microbatches, bool)
        or num_microbatches < 1
    ):
        raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}.")
    k = int(num_microbatches)
    step = kernel.Step.create(
        fn, api="jaxmp.accumulate_value_and_grad", argnums=argnums,
        no_cast_argnums=no_cast_argnums, has_aux=has_aux, compute_dtype=compute_dtype,
        use_mixed_precision=use_mixed_precision, axis_name=axis_name, autocast=autocast,
        reduce_dtype=reduce_dtype, matmul_dtype=matmul_dtype, float8_scaling=float8_scaling)
    batch_nums = None if batch_argnums is None else kernel.int_tuple(batch_argnums,
                                                                     "batch_argnums")

    @kernel.wraps_adding_scaler_state(fn)
    def accumulated_fn(*args, scaler_state=kernel.REQUIRED, **kwargs):
        state = step.check_state(scaler_state)
        n = len(args)
        positions = kernel.resolve_positions(step.nums, n, "argnums", argnums)
        if batch_nums is None:
            skip = set(positions) | set(step.no_cast_positions(n))
            batch_positions = [i for i in range(n) if i not in skip]
        else:
            batch_positions = kernel.resolve_positions(batch_nums, n, "batch_argnums", batch_nums)
            overlap = sorted(set(batch_positions) & set(positions))
            if overlap:
                raise ValueError(
                    f"Arguments {overlap} are in both argnums and batch_argnums: a "
                    "differentiated argument cannot be split into micro-batches."
                )
        if not batch_positions:
            raise ValueError(
                "There is no batch argument to split into micro-batches: pass the batch "
                "as a positional argument not in argnums, or set batch_argnums."
            )
        diff, rebuild, devices = step.differentiable(args, state)
        batch = _Batch(args, batch_positions, k)
        views = step.traced_views(diff)

        def body(acc, micro_leaves):
            (_, (loss, aux)), grads = jax.value_and_grad(
                lambda d: step.scaled_loss(state, batch.rebuild(rebuild(d), micro_leaves), kwargs),
                has_aux=True)(views)
            acc = jax.tree_util.tree_map(lambda a, g: a + g.astype(a.dtype), acc, grads)
            return acc, (loss, aux)

        # Scaled gradients are summed in float32 (float64 stays float64).
        # Each carry leaf has its parameter's varying axes, so scan's carry types match.
        acc = jax.tree_util.tree_map(
            lambda x: sharding.as_varying(jnp.zeros(x.shape, casting.wide_dtype(x.dtype)),
                                          tuple(sharding.varying_axes(x))), diff)
        acc, (losses, aux) = jax.lax.scan(body, acc, batch.leaves)
        grads = step.unscale(state, acc, diff, divisor=k)
        return step.finish(jnp.mean(losses), aux, grads, state, devices)

    return accumulated_fn
