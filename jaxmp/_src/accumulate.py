"""Gradient accumulation over micro-batches, with one loss scale per window.

:func:`accumulate_value_and_grad` splits the batch arguments of a loss function
into ``num_microbatches`` micro-batches (with its ``split`` function; by default
every array along its leading axis) and runs a ``lax.scan`` over them inside
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
    """A typed PRNG key array, or what a raw ``jax.random.PRNGKey`` looks like (uint32[2], [4])."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return True
    return x.dtype == np.uint32 and np.ndim(x) == 1 and x.shape[0] in (2, 4)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


# The fields of jraph's GraphsTuple: recognised by name (jraph is not a dependency).
_GRAPH_FIELDS = frozenset(("nodes", "edges", "receivers", "senders", "globals", "n_node",
                           "n_edge"))
_SPLIT_HINT = ("Pass split=, a function (batch, num_microbatches) -> the micro-batches stacked "
               "along a new leading axis (docs/accumulation.md shows one for a padded graph "
               "batch)")


def _is_graph(x: Any) -> bool:
    return isinstance(x, tuple) and _GRAPH_FIELDS <= set(getattr(x, "_fields", ()))


def _where(positions: Sequence[int], path: tuple) -> str:
    """``argument 1 leaf ['xy'][0]``, from a path into the tuple of batch arguments."""
    pos, rest = positions[path[0].idx], path[1:]
    return f"argument {pos}" + (f" leaf {jax.tree_util.keystr(rest)}" if rest else "")


def _refuse_graphs(batch: tuple, positions: Sequence[int]) -> None:
    for path, x in jax.tree_util.tree_flatten_with_path(batch, is_leaf=_is_graph)[0]:
        if _is_graph(x):
            raise ValueError(
                f"{_where(positions, path)} is a graph batch (a GraphsTuple): its senders and "
                "receivers are indices into its nodes, and n_node and n_edge count nodes and "
                "edges per graph, so splitting each of its arrays along the leading axis gives "
                "micro-batches whose edges point at the wrong nodes. "
                f"{_SPLIT_HINT}: one that splits by graphs and re-indexes senders and receivers.")


def _indivisible(k: int, where: str, shape: tuple) -> ValueError:
    return ValueError(
        f"Every array in the batch arguments must have a leading batch axis divisible by "
        f"num_microbatches={k}; {where} has shape {shape}. If this argument is "
        "not part of the batch, leave it out of batch_argnums.")


def _split_rows(batch: tuple, k: int, positions: Sequence[int]) -> tuple:
    """The default ``split``: every array cut into ``k`` equal slices along its leading axis.

    Sound when row ``i`` of every array belongs to example ``i``; it refuses
    what it can tell is not so (a GraphsTuple, arrays of different leading
    sizes). A PRNG key whose leading axis is not the batch axis (a single key,
    raw or typed) is given whole to every micro-batch; other non-array leaves
    are passed as they are.
    """
    _refuse_graphs(batch, positions)
    rows: dict[int, list[tuple[str, tuple]]] = {}  # leading size -> those arrays, shapes
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if _is_array(x) and not _is_key(x):
            where = _where(positions, path)
            if np.ndim(x) == 0:
                raise _indivisible(k, where, ())
            rows.setdefault(x.shape[0], []).append((where, tuple(x.shape)))
    for n, named in rows.items():
        if n % k:
            raise _indivisible(k, *named[0])
    if len(rows) > 1:
        sizes = "; ".join(
            f"{', '.join(w for w, _ in named[:3])}{' ...' if len(named) > 3 else ''}: {n}"
            for n, named in sorted(rows.items()))
        raise ValueError(
            f"The batch arrays have different leading sizes ({sizes}), so their rows are not one "
            "per example, and cutting each into equal slices may give micro-batches whose "
            "parts belong to different examples, or whose indices point at the wrong rows. "
            f"{_SPLIT_HINT}; for arrays that hold a fixed number of rows per example, "
            "split=lambda batch, k: jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[1:]), "
            "batch). An argument that is not part of the batch belongs out of batch_argnums.")

    def split(x):
        if not _is_array(x):
            return x
        if _is_key(x) and (np.ndim(x) == 0 or x.shape[0] not in rows):
            return jnp.broadcast_to(x, (k,) + tuple(x.shape))  # the same key for every one
        return x.reshape((k, x.shape[0] // k) + tuple(x.shape[1:]))

    return jax.tree_util.tree_map(split, batch)


class _Micro:
    """The micro-batches of one call: the batch arguments stacked along a new leading axis.

    ``leaves`` are the stacked array leaves (what ``lax.scan`` runs over);
    ``rebuild`` puts one micro-batch of them back into the full argument list,
    with the non-array leaves as ``split`` returned them.
    """

    def __init__(self, stacked: Any, positions: Sequence[int], k: int):
        if not isinstance(stacked, (tuple, list)) or len(stacked) != len(positions):
            raise ValueError(
                f"split= must return one entry per batch argument ({len(positions)}: "
                f"arguments {list(positions)}), as a tuple, got {type(stacked).__name__}.")
        self.positions = positions
        with_paths, self.treedef = jax.tree_util.tree_flatten_with_path(tuple(stacked))
        self.static = [(_is_array(x), None if _is_array(x) else x) for _, x in with_paths]
        self.leaves = [x for _, x in with_paths if _is_array(x)]
        for path, x in with_paths:
            if _is_array(x) and (np.ndim(x) == 0 or x.shape[0] != k):
                raise ValueError(
                    f"split= returned {_where(positions, path)} with shape "
                    f"{tuple(np.shape(x))}: every array it returns needs a leading axis of "
                    f"size num_microbatches={k}, one entry per micro-batch.")

    def rebuild(self, args: Sequence[Any], micro_leaves: Sequence[Any]) -> list[Any]:
        it = iter(micro_leaves)
        merged = [next(it) if array else x for array, x in self.static]
        full = list(args)
        for pos, value in zip(self.positions, jax.tree_util.tree_unflatten(self.treedef, merged)):
            full[pos] = value
        return full


def accumulate_value_and_grad(
    fn: Callable,
    num_microbatches: int,
    *,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] | None = None,
    split: Callable[[tuple, int], Sequence[Any]] | None = None,
    no_cast_argnums: int | Sequence[int] = (),
    has_aux: bool = False,
    compute_dtype: Any = jnp.bfloat16,
    use_mixed_precision: bool = True,
    axis_name: Any = None,
    autocast: bool = True,
    reduce_dtype: Any = None,
    matmul_dtype: Any = None,
    float8_scaling: str = "tensor",
    float8_rules: Any = None,
) -> Callable:
    """Like :func:`jaxmp.mp_value_and_grad`, accumulated over micro-batches.

    The returned function is called like the one :func:`jaxmp.mp_value_and_grad`
    returns, ``(*args, scaler_state=state, **kwargs)``, with a full batch. The
    positional arguments in ``batch_argnums`` (by default all positional
    arguments not in ``argnums``) are the batch: ``split`` cuts them into
    ``num_microbatches`` micro-batches; the other arguments and all keyword
    arguments are passed unchanged to every micro-batch.

    The default ``split`` cuts every array leaf into equal slices along its
    leading axis. That is right when row ``i`` of every array belongs to
    example ``i``, and it refuses the batches it can tell are not so: arrays of
    different leading sizes (the nodes, edges and per-graph counts of a graph
    batch; arrays with several rows per example) and a jraph ``GraphsTuple``
    (recognised by its fields), whose ``senders`` and ``receivers`` index its
    nodes. It cannot tell an integer array that indexes rows of another array
    from labels: a batch whose arrays hold indices into each other, however
    they are shaped, needs a ``split`` of its own.

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
            int >= 1); with the default ``split``, the leading axis of every
            batch array must be divisible by it.
        argnums: which positional arguments to differentiate.
        batch_argnums: which positional arguments hold the batch. Defaults to
            every positional argument not in ``argnums`` or
            ``no_cast_argnums``. Non-array leaves of these arguments (Python
            numbers, ``None``) are not split, and neither is a single PRNG key
            (raw or typed): every micro-batch gets the same key. To vary a key
            per micro-batch, pass one key per example (e.g.
            ``jax.random.split(key, batch_size)``) as part of the batch.
        split: how the batch is cut into micro-batches: a function
            ``split(batch, num_microbatches)`` that receives the tuple of the
            batch arguments (in the order of their positions) and returns a
            tuple of the same length, each entry that argument's micro-batches
            stacked along a new leading axis of size ``num_microbatches``
            (``lax.scan`` runs over it); micro-batch ``i`` is entry ``[i]`` of
            every array. Non-array leaves are passed as they are. ``None``
            (default) cuts every array into equal slices along its leading
            axis, as said above. For a graph batch, a ``split`` that splits by
            graphs, re-indexes ``senders`` and ``receivers`` and pads every
            micro-batch to the same sizes: ``docs/accumulation.md``.
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
            (default), ``"mxfp8"`` (block-scaled float8 products, with
            ``matmul_dtype=jnp.float8_e4m3fn``) or ``"nvfp4"`` (4-bit products,
            with ``matmul_dtype=jnp.float4_e2m1fn``).
        float8_rules: as in :func:`jaxmp.mp_value_and_grad`.

    Returns:
        A function returning ``(loss, grads, scaler_state, finite)``, or
        ``((loss, aux), grads, scaler_state, finite)`` with ``has_aux=True``.

    Raises:
        ValueError: if ``num_microbatches`` is not an int >= 1, if
            ``batch_argnums`` overlaps ``argnums``, or (when called) if the
            default ``split`` meets a batch array whose leading axis is not
            divisible by ``num_microbatches``, arrays of different leading
            sizes or a ``GraphsTuple``, or a ``split`` returns arrays without a
            leading axis of size ``num_microbatches``.
        TypeError: for the misuse :func:`jaxmp.mp_value_and_grad` rejects,
            or a ``split`` that is not callable.

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
    if split is not None and not callable(split):
        raise TypeError(f"split must be a function (batch, num_microbatches), got {split!r}.")
    step = kernel.Step.create(
        fn, api="jaxmp.accumulate_value_and_grad", argnums=argnums,
        no_cast_argnums=no_cast_argnums, has_aux=has_aux, compute_dtype=compute_dtype,
        use_mixed_precision=use_mixed_precision, axis_name=axis_name, autocast=autocast,
        reduce_dtype=reduce_dtype, matmul_dtype=matmul_dtype, float8_scaling=float8_scaling,
        float8_rules=float8_rules)
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
        batch = tuple(args[pos] for pos in batch_positions)
        batch = _Micro(_split_rows(batch, k, batch_positions) if split is None
                       else split(batch, k), batch_positions, k)
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
