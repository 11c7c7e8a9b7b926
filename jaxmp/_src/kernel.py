"""The one gradient step behind every jaxmp gradient function.

:func:`jaxmp.mp_value_and_grad`, :func:`jaxmp.mp_grad` and
:func:`jaxmp.accumulate_value_and_grad` are thin wrappers around a
:class:`Step`: it validates the options once, when the wrapper is built, and
then, on each call,

1. checks ``scaler_state`` (:meth:`Step.check_state`);
2. splits the differentiated arguments into floating-point leaves and the rest
   (:meth:`Step.differentiable`);
3. runs the loss with its inputs cast (or under autocast), converts it to
   float32 and multiplies it by the scale (:meth:`Step.scaled_loss`);
4. divides the gradients by the scale of that same backward pass, in float32,
   and returns each in the dtype of its parameter (:meth:`Step.unscale`);
5. reduces over devices, checks finiteness, adjusts the scaler and packs the
   results (:meth:`Step.finish`).

The wrappers differ only in what they do between 3 and 4: one backward pass, or
a ``lax.scan`` of them over micro-batches.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import casting
from jaxmp._src import census
from jaxmp._src import compat
from jaxmp._src import interpret
from jaxmp._src import jaxprs
from jaxmp._src import loss_scale
from jaxmp._src import messages
from jaxmp._src import sharding
from jaxmp._src import wide_gradients

PyTree = Any


class _Required:
    """The default of ``scaler_state``: tells a missing argument from a wrong one."""

    def __repr__(self) -> str:
        return "<required>"


REQUIRED = _Required()

# The largest scale (a power of two) whose product with a float16 loss's own
# gradient, 1, fits in float16 (65504).
FLOAT16_LOSS_MAX_SCALE = 2.0**15


def missing_scaler_state(api: str) -> TypeError:
    """The error for a call that forgot ``scaler_state=``, naming the function that needs it."""
    return TypeError(
        f"The function returned by {api} needs the keyword argument scaler_state=, the "
        "loss-scaling state that it returns updated. Create it once with "
        "jaxmp.scaler_for(compute_dtype) (for float16 a dynamic loss scaler, "
        "jaxmp.init_scaler(); for bfloat16 and float32 none, jaxmp.noop_scaler()), and pass "
        "back the one each step returns."
    )


def int_tuple(value: Any, name: str, *, allow_empty: bool = False) -> tuple[int, ...]:
    """``value`` (an int or a sequence of ints, never bools) as a tuple, or ``TypeError``."""
    out = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    try:
        out = tuple(out)
    except TypeError:
        out = None
    if (
        out is None
        or (not out and not allow_empty)
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in out)
    ):
        kind = "a sequence" if allow_empty else "a non-empty sequence"
        raise TypeError(f"{name} must be an int or {kind} of ints, got {value!r}.")
    return out


def resolve_positions(nums: Sequence[int], n_args: int, name: str, given: Any) -> list[int]:
    """Non-negative positions of ``nums`` among ``n_args`` positional arguments."""
    out = []
    for i in nums:
        if not -n_args <= i < n_args:
            raise TypeError(
                f"{name}={given!r} refers to argument {i}, but the function was "
                f"called with {n_args} positional arguments."
            )
        out.append(i % n_args)
    return out


def wraps_adding_scaler_state(fn: Callable) -> Callable:
    """Like ``functools.wraps``, for a wrapper that adds a keyword-only ``scaler_state``.

    ``functools.wraps`` would set ``__wrapped__``, making ``inspect.signature``
    report ``fn``'s signature, which has no ``scaler_state``; tools that bind
    arguments to the signature, such as ``equinox.filter_jit``, then reject the
    call. The name and docstring are copied, ``__wrapped__`` is not kept.
    """

    def decorate(wrapper: Callable) -> Callable:
        functools.update_wrapper(wrapper, fn)
        del wrapper.__wrapped__
        return wrapper

    return decorate


def check_loss(loss: Any) -> jax.Array:
    """``loss`` as a scalar floating-point array, or ``TypeError`` saying what it is instead."""
    if not isinstance(loss, (jax.Array, float, int)) or isinstance(loss, bool):
        raise TypeError(
            "The loss function must return a scalar floating-point array (or a pair "
            f"(loss, aux) with has_aux=True), got {type(loss).__name__}."
        )
    loss = jnp.asarray(loss)
    if loss.shape != ():
        raise TypeError(
            f"The loss must be a scalar, got an array of shape {loss.shape}. "
            "Reduce it (e.g. with jnp.mean) before returning it."
        )
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(f"The loss must have a floating-point dtype, got {loss.dtype}.")
    return loss


def split_aux(out: Any, has_aux: bool) -> tuple[Any, Any]:
    """``(loss, aux)`` from what the loss function returned."""
    if not has_aux:
        return out, None
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        if isinstance(out, (tuple, list)):
            got = f"a {type(out).__name__} of length {len(out)}"
        elif hasattr(out, "shape") and hasattr(out, "dtype"):
            got = f"a single array of shape {tuple(out.shape)}; without aux, use has_aux=False"
        else:
            got = type(out).__name__
        raise TypeError(
            f"With has_aux=True the loss function must return a pair (loss, aux), got {got}."
        )
    return out[0], out[1]


def prepare_call(fn: Callable, compute_dtype: Any, use_mixed_precision: bool, autocast: bool,
                 matmul_dtype: Any = None, float8_scaling: str = "tensor",
                 autocast_rules: Any = None, float8_rules: Any = None):
    """Checks ``compute_dtype`` and returns ``(call, input_dtype)`` for a gradient step.

    ``call`` is the function to differentiate; ``input_dtype`` is the dtype its
    floating inputs are cast to, or ``None`` when ``autocast`` chooses the
    precision of each operation itself. ``matmul_dtype`` (a float8 dtype),
    ``float8_scaling`` (its recipe), ``float8_rules`` (a
    :class:`jaxmp.experimental.Float8Rules`, or ``None`` for the recipe's) and
    ``autocast_rules`` (a :class:`jaxmp.AutocastRules`, or ``None`` for the
    defaults) go to autocast, which they need.
    """
    compute_dtype = casting.canonical_float_dtype(
        compute_dtype, allowed=casting.COMPUTE_DTYPES, what="compute_dtype"
    )
    from jaxmp._src import float8  # pylint: disable=g-import-not-at-top

    matmul_dtype = float8.check_matmul_dtype(matmul_dtype, compute_dtype)
    float8.check_scaling(float8_scaling, matmul_dtype)
    if matmul_dtype is not None and not autocast:
        raise ValueError(
            f"matmul_dtype={matmul_dtype.name} needs autocast=True: float8 products are "
            "placed per operation by jaxmp.autocast (casting the inputs cannot do it).")
    if float8_rules is not None and matmul_dtype is None:
        raise ValueError(
            "float8_rules= says which matrix products run in float8, but matmul_dtype is None "
            "(products in the compute dtype). Pass matmul_dtype=jnp.float8_e4m3fn with "
            "float8_rules, or drop float8_rules.")
    if autocast_rules is not None:
        from jaxmp._src.autocast import rules as rules_lib  # pylint: disable=g-import-not-at-top

        if not isinstance(autocast_rules, rules_lib.AutocastRules):
            raise TypeError(
                "autocast_rules must be a jaxmp.AutocastRules, e.g. jaxmp.AutocastRules("
                "full_precision=jaxmp.autocast.FULL_PRECISION | {'tanh'}); got "
                f"{type(autocast_rules).__name__}.")
        if not autocast:
            raise ValueError(
                "autocast_rules= needs autocast=True: the rules say which operations "
                "jaxmp.autocast runs in which precision, and autocast=False runs the loss as "
                "written on inputs cast to compute_dtype. Drop autocast=False, or drop "
                "autocast_rules (jaxmp.force_full_precision runs chosen code in float32 "
                "without autocast).")
    if not use_mixed_precision:
        return fn, jnp.dtype(jnp.float32)
    if autocast:
        from jaxmp._src import autocast as autocast_lib  # pylint: disable=g-import-not-at-top

        rules = {} if autocast_rules is None else {"rules": autocast_rules}
        if float8_rules is not None:
            rules["float8_rules"] = float8_rules
        return autocast_lib.autocast(fn, compute_dtype=compute_dtype, matmul_dtype=matmul_dtype,
                                     float8_scaling=float8_scaling,  # the options too (NVFP4)
                                     **rules), None
    return fn, compute_dtype


def _state_spec(compute_dtype: Any, autocast: bool, matmul_dtype: Any,
                float8_scaling: str) -> Any:
    """The state spec of the float8 recipe a step runs (``None``: no float8, or no state)."""
    if not autocast:
        return None
    from jaxmp._src import float8  # pylint: disable=g-import-not-at-top

    matmul_dtype = float8.check_matmul_dtype(matmul_dtype, compute_dtype)
    return None if matmul_dtype is None else float8.check_scaling(float8_scaling,
                                                                  matmul_dtype).state


def returned_state_dtypes(aux: PyTree, states: Sequence[PyTree]) -> PyTree:
    """``aux`` with its floating leaves in float32, except the framework state it returns.

    A subtree of ``aux`` with the tree structure and leaf shapes of one of
    ``states`` (the arguments in ``no_cast_argnums``, then the other arguments
    not differentiated: Haiku state, Flax ``batch_stats``, an Equinox
    ``State``; a single array is never one) is that state returned updated: its
    floating leaves come back in the dtypes of the state passed in, so the new
    state can replace the old one (``jaxmp.select_tree``, ``lax.scan``) whatever
    dtype it was initialised in. Every other floating leaf comes back in float32.
    """
    templates = []
    for s in states:
        leaves, treedef = jax.tree_util.tree_flatten(s)
        if leaves and not jax.tree_util.treedef_is_leaf(treedef):
            templates.append((treedef, leaves))

    def template_of(node):
        leaves, treedef = jax.tree_util.tree_flatten(node)
        for t_def, t_leaves in templates:
            if treedef == t_def and all(np.shape(x) == np.shape(t)
                                        for x, t in zip(leaves, t_leaves)):
                return treedef, leaves, t_leaves
        return None

    def restore(node):
        found = template_of(node)
        if found is None:
            return casting.cast_tree(node, jnp.float32)
        treedef, leaves, t_leaves = found
        return jax.tree_util.tree_unflatten(treedef, [
            x.astype(t.dtype) if casting.is_float_array(x) and casting.is_float_array(t) else x
            for x, t in zip(leaves, t_leaves)])

    if not templates:
        return casting.cast_tree(aux, jnp.float32)
    return jax.tree_util.tree_map(restore, aux, is_leaf=lambda n: template_of(n) is not None)


def warn_if_half_master_weights(diff: PyTree, state: loss_scale.ScalerState,
                                use_mixed_precision: bool = True) -> None:
    """Warns, at trace time, when half-precision parameters are trained under float16 scaling.

    Called by the gradient step with the leaves it differentiates. With a
    dynamic or static loss scale (float16 training) the parameters should be
    float32 master weights: float16 parameters make the optimizer's arithmetic
    and the update itself run in float16, where small updates round away and
    large ones overflow. Pure bfloat16 training (a ``noop_scaler``) is a
    legitimate choice and stays quiet.
    """
    if not use_mixed_precision or state.mode == "none":
        return
    leaves = jax.tree_util.tree_leaves_with_path(diff)
    half = [(path, x) for path, x in leaves
            if casting.is_float_array(x) and casting.is_narrow_dtype(x.dtype)]
    if not half:
        return
    path, x = half[0]
    warnings.warn(
        f"jaxmp: {len(half)} of {len(leaves)} differentiated parameter arrays are in half "
        f"precision (e.g. {jax.tree_util.keystr(path) or 'the argument'}: {x.dtype}) while the "
        f"loss is scaled for float16 ({state.mode} loss scaling). Keep master weights in "
        "float32: mp_value_and_grad casts them to the compute dtype for the forward and "
        "backward pass, and the optimizer then updates float32 values (in half precision, "
        "small updates round away and Adam's moments overflow). Cast them with "
        "jaxmp.cast_tree(params, jnp.float32) before optimizer.init; with Haiku, set policies "
        "after init or use params=float32 (jaxmp.get_policy('p=f32,c=f16,o=f32')).",
        UserWarning,
        stacklevel=3,
    )


@dataclasses.dataclass
class Learnt:
    """What tracing a :class:`Step` learnt, for the rest of the step and for later traces.

    Attributes:
        counted: the cast-inputs path's products were counted by dtype (the
            check runs on the first trace only, so it is said once).
        float16_loss: the loss itself came out in float16 (its scale is then
            capped, :data:`FLOAT16_LOSS_MAX_SCALE`).
    """

    counted: bool = False
    float16_loss: bool = False


@dataclasses.dataclass(frozen=True)
class Step:
    """The validated options of one jaxmp gradient function.

    Build it with :meth:`Step.create` when the user's wrapper is created, so
    that bad options fail there and not on the first call.
    """

    api: str
    call: Callable
    input_dtype: Any
    argnums: Any
    nums: tuple[int, ...]
    no_cast_nums: tuple[int, ...]
    has_aux: bool
    use_mixed_precision: bool
    axis_name: Any
    reduce_dtype: Any = None
    compute_dtype: Any = None
    # Whether the cast-inputs path counts the loss's products by dtype on its first trace
    # (MostlyFloat32Warning): a training step does, a diagnosis (find_nonfinite) does not.
    check_share: bool = True
    # The state a float8 recipe carries (float8_scaling="delayed": a float8.StateSpec), passed
    # as float8_state= and returned updated; None for the others.
    float8_state: Any = None
    # What tracing learnt, for the rest of the step and for later traces; written by this
    # class's methods only.
    learnt: Learnt = dataclasses.field(default_factory=Learnt, compare=False)

    @classmethod
    def create(
        cls,
        fn: Callable,
        *,
        api: str,
        argnums: Any,
        no_cast_argnums: Any,
        has_aux: bool,
        compute_dtype: Any,
        use_mixed_precision: bool,
        axis_name: Any,
        autocast: bool,
        reduce_dtype: Any = None,
        matmul_dtype: Any = None,
        float8_scaling: str = "tensor",
        check_share: bool = True,
        autocast_rules: Any = None,
        float8_rules: Any = None,
    ) -> "Step":
        """Validates the options of ``api`` (e.g. ``"jaxmp.mp_value_and_grad"``);
        ``check_share=False`` leaves out the trace-time count of the products by dtype (see
        :attr:`check_share`)."""
        if not callable(fn):
            raise TypeError(f"{api} expects a function, got {type(fn).__name__}.")
        nums = int_tuple(argnums, "argnums")
        no_cast = int_tuple(no_cast_argnums, "no_cast_argnums", allow_empty=True)
        both = sorted(set(nums) & set(no_cast))
        if both:
            raise ValueError(
                f"Arguments {both} are in both argnums and no_cast_argnums: a differentiated "
                "argument is always cast to the compute dtype, so it cannot also be left "
                "uncast. Remove it from one of them."
            )
        call, input_dtype = prepare_call(fn, compute_dtype, use_mixed_precision, autocast,
                                         matmul_dtype, float8_scaling, autocast_rules,
                                         float8_rules)
        reduce_dtype = sharding.check_reduce_dtype(reduce_dtype)
        if use_mixed_precision:  # under jit, XLA's gradient all-reduces in reduce_dtype
            call = wide_gradients.widen_gradient_products(call, reduce_dtype)
        compute_dtype = casting.canonical_float_dtype(
            compute_dtype, allowed=casting.COMPUTE_DTYPES, what="compute_dtype")
        return cls(api=api, call=call, input_dtype=input_dtype, argnums=argnums, nums=nums,
                   no_cast_nums=no_cast, has_aux=has_aux,
                   use_mixed_precision=use_mixed_precision, axis_name=axis_name,
                   reduce_dtype=reduce_dtype, compute_dtype=compute_dtype,
                   check_share=check_share,
                   float8_state=_state_spec(compute_dtype, use_mixed_precision and autocast,
                                            matmul_dtype, float8_scaling))

    def split_float8_state(self, kwargs: dict) -> tuple[Any, dict]:
        """``(float8_state, other kwargs)``: the float8 recipe's state, checked (an error naming
        the fix when it is missing), or ``None`` for a recipe without state."""
        if self.float8_state is None:
            return None, kwargs
        kwargs = dict(kwargs)
        return self.float8_state.check(kwargs.pop("float8_state", None)), kwargs

    def updated_float8_state(self, old: Any, grad: Any) -> Any:
        """The float8 state this step returns, from ``old`` and the gradient of the loss with
        respect to it, which the recipe's backward pass fills with what it records
        (``float8/delayed.py``). Never unscaled and not part of the finiteness check: a
        skipped step still records its amaxes (the non-finite ones are not recorded)."""
        return self.float8_state.update(old, grad)

    @property
    def single_argnum(self) -> bool:
        return isinstance(self.argnums, int)

    def check_state(self, scaler_state: Any) -> loss_scale.ScalerState:
        """The scaler state the user passed, checked once per call.

        A dynamic loss scale with bfloat16 is said, once, while tracing: it
        rescues nothing there (bfloat16 has float32's range) and it skips the
        steps of its first descent from ``2**15``.
        """
        if scaler_state is REQUIRED:
            raise missing_scaler_state(self.api)
        state = loss_scale.check_scaler_state(scaler_state)
        if (self.use_mixed_precision and state.mode == "dynamic"
                and self.compute_dtype == jnp.bfloat16):
            messages.warn_once(
                ("dynamic scaler with bfloat16", self.api),
                f"jaxmp: {self.api} computes in bfloat16 (compute_dtype=jnp.bfloat16, jaxmp's "
                "default) with a dynamic loss scaler (jaxmp.init_scaler). bfloat16 has "
                "float32's exponent range, so a loss scale rescues no small gradient; it only "
                "skips steps while it backs off from its initial scale. Use "
                "jaxmp.scaler_for(jnp.bfloat16) (no scaling; non-finite steps are still "
                "skipped), or pass compute_dtype=jnp.float16 if you meant float16, whose "
                "gradients do need the scale.",
                UserWarning)
        return state

    def differentiable(self, args: Sequence[Any], state: loss_scale.ScalerState
                       ) -> tuple[tuple[PyTree, ...], Callable, sharding.Plan]:
        """The floating-point leaves of the differentiated arguments, and how to put them back.

        Returns ``(diff, rebuild, devices)``: ``diff`` holds one tree per
        differentiated argument, with ``None`` in place of leaves that are not
        floating-point arrays (inside ``shard_map``, marked varying over the
        data axes); ``rebuild(diff)`` returns the full argument list with
        those leaves replaced; ``devices`` is for :meth:`finish`. Warns, while
        tracing, about half-precision parameters under float16 loss scaling.
        """
        positions = resolve_positions(self.nums, len(args), "argnums", self.argnums)
        diff, rebuild = jaxprs.at_positions(args, positions)
        if not any(casting.is_float_array(x) for x in jax.tree_util.tree_leaves(diff)):
            raise TypeError(
                f"No floating-point array leaves to differentiate in the argument(s) "
                f"argnums={self.argnums!r}. Gradients are taken with respect to float arrays only."
            )
        warn_if_half_master_weights(diff, state, self.use_mixed_precision)
        diff, devices = sharding.prepare(diff, self.axis_name)
        return diff, rebuild, devices

    def traced_views(self, diff: PyTree) -> PyTree:
        """What the loss is traced and differentiated on: float32 views of half-precision leaves.

        Under autocast (the inputs are not cast), half-precision parameters
        are handed to the loss as float32 views (exact), so that framework
        code that checks dtypes, or a convolution of a bfloat16 weight with
        float32 noise drawn inside the loss, sees one dtype; autocast still
        runs the products in the compute dtype. The gradients are taken with
        respect to the views, in float32, and :meth:`unscale` returns each in
        its parameter's own dtype.
        """
        return diff if self.input_dtype is not None else casting.widen_half(diff)

    def no_cast_positions(self, n_args: int) -> list[int]:
        return resolve_positions(self.no_cast_nums, n_args, "no_cast_argnums", self.no_cast_nums)

    def scaled_loss(self, state: loss_scale.ScalerState, args: Sequence[Any],
                    kwargs: dict) -> tuple[jax.Array, tuple[jax.Array, Any]]:
        """Runs the loss on ``args`` and returns ``(scaled_loss, (loss, aux))``, all float32.

        Floating inputs are cast to the compute dtype first, except the
        arguments in ``no_cast_argnums``. The loss is converted to float32
        *before* it is multiplied by the scale, so the product cannot overflow
        float16; floating aux leaves come back in float32, except an argument
        that is not differentiated (``no_cast_argnums`` first) returned updated
        (:func:`returned_state_dtypes`).
        Under autocast, every half-precision floating leaf of the inputs is
        handed to the loss as an exact float32 view (``casting.widen_half``): the
        user's code and its framework's dtype checks (``lax.conv`` refuses a bfloat16
        weight with float32 noise) see one dtype, and autocast still runs each
        product in the compute dtype.
        """
        args = list(args)
        # The state the loss may return updated: the no_cast_argnums first, then every
        # other argument that is not differentiated (framework state a user passes without
        # no_cast_argnums, e.g. cast to bfloat16 by hand: issue 34).
        kept = self.no_cast_positions(len(args))
        differentiated = set(resolve_positions(self.nums, len(args), "argnums", self.argnums))
        states = [args[i] for i in kept] + [
            a for i, a in enumerate(args) if i not in differentiated and i not in kept]
        if self.input_dtype is None:
            args, kwargs = casting.widen_half((args, kwargs))
        else:
            keep = set(self.no_cast_positions(len(args)))
            cast = [a for i, a in enumerate(args) if i not in keep]
            cast, kwargs = casting.cast_tree((cast, kwargs), self.input_dtype)
            it = iter(cast)
            args = [a if i in keep else next(it) for i, a in enumerate(args)]
        call = self.call
        if (self.check_share and casting.is_narrow_dtype(self.input_dtype)
                and not self.learnt.counted):
            # On the first trace only: trace the loss to a jaxpr, count its
            # products by dtype, then evaluate that jaxpr (one trace of the
            # user's code, as without the check).
            self.learnt.counted = True

            def census_then_run(closed, arrays):
                census.warn_if_mostly_float32(closed, self.input_dtype, self.api)
                # Each equation bound as traced (nested jits stay calls), so the
                # program is the one the user's code gives. Operations on the
                # jaxpr's constants run eagerly in NumPy, which warns about
                # overflows that tracing the user's code did not.
                with np.errstate(all="ignore"):
                    return compat.eval_jaxpr(closed.jaxpr, closed.consts, *arrays)

            call = interpret.transform(self.call, census_then_run)
        loss, aux = split_aux(call(*args, **kwargs), self.has_aux)
        loss = check_loss(loss)
        self.learnt.float16_loss = loss.dtype == jnp.float16
        loss = loss.astype(jnp.float32)
        if not self.use_mixed_precision:
            return loss, (loss, aux)
        return loss_scale.scale(state, loss), (loss, returned_state_dtypes(aux, states))

    def unscale(self, state: loss_scale.ScalerState, grads: PyTree, diff: PyTree,
                divisor: int = 1) -> PyTree:
        """Divides summed scaled gradients by the scale (in float32) and by ``divisor``.

        Each gradient comes back in the dtype of the leaf of ``diff`` it belongs to.
        """
        if self.use_mixed_precision:
            grads = loss_scale.unscale(state, grads)
        if divisor != 1:
            grads = jax.tree_util.tree_map(
                lambda g: g * jnp.asarray(1.0 / divisor, g.dtype), grads)
        return jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), grads, diff)

    def finish(self, loss: jax.Array, aux: Any, grads: PyTree, state: loss_scale.ScalerState,
               devices: sharding.Plan) -> tuple[Any, PyTree, loss_scale.ScalerState, jax.Array]:
        """The end of every step, once the gradients are unscaled.

        Averages loss and gradients over the data axes (in ``reduce_dtype``),
        checks finiteness (the same answer on every device of the mesh),
        adjusts the scaler, and packs the results as
        :func:`jaxmp.mp_value_and_grad` returns them.
        """
        loss, grads = sharding.mean_over_devices(loss, grads, devices, self.reduce_dtype)
        finite = loss_scale.all_finite(grads, devices.axes or None)  # one verdict, every axis
        if self.use_mixed_precision:
            state = loss_scale.adjust(state, finite)
            if self.learnt.float16_loss and state.max_scale > FLOAT16_LOSS_MAX_SCALE:
                # The gradient of a float16 loss with respect to itself is the
                # scale, in float16: from 2**16 on it is inf, and every step skips.
                state = state.replace(scale=jnp.minimum(state.scale, FLOAT16_LOSS_MAX_SCALE))
        grads = grads[0] if self.single_argnum else grads
        value = (loss, aux) if self.has_aux else loss
        return value, grads, state, finite
