"""What a step does besides returning: the updates it makes in place, for the measures.

The FLOP tools of :mod:`jaxmp.debug` trace a step and count what its outputs
need (dead code is dropped, as XLA drops it). A Flax NNX step updates its
model and its ``nnx.Optimizer`` in place and may return nothing, or the loss
alone: traced as it is, its backward pass and its update would count as dead.

:func:`functional` makes such a step a pure function of the state of its NNX
arguments (``nnx.split`` outside, ``nnx.merge`` inside) that also returns their
new state, as ``nnx.jit`` itself does, so that every update counts.
:func:`refuse_if_uncounted` refuses a function all of whose products are dead
because it keeps their results elsewhere (a dict or an object it closes over).
Flax is not imported here: a program that has not imported ``flax.nnx`` has no
NNX arguments.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import jax

from jaxmp._src import census
from jaxmp._src import jaxprs


def functional(fn: Callable, args: tuple, kwargs: dict, *,
               returns_state: bool = True) -> tuple[Callable, tuple, dict]:
    """``fn`` over the state of the NNX graph nodes among its arguments, and those arguments.

    Each graph node (an ``nnx.Module``, ``nnx.Optimizer``, ``nnx.Rngs``...) of
    ``(args, kwargs)`` is replaced by its ``nnx.State`` (one ``nnx.split`` of
    all of them, so that what they share stays shared); the returned function
    merges them back, calls ``fn`` and returns ``(output, new state)`` (only the
    output when ``returns_state`` is false). Without graph nodes, ``fn``,
    ``args`` and ``kwargs`` come back as they are.

    Args:
        fn: any function.
        args: its positional arguments.
        kwargs: its keyword arguments.
        returns_state: whether the function also returns the nodes' state after
            the call (what an in-place update changed).

    Returns:
        ``(function, args, kwargs)``, with the arguments in the same places.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        >>> def scale(model, factor):  # in place, returns nothing
        ...     model.kernel[...] = model.kernel[...] * factor
        >>> pure, args, kwargs = functional(scale, (model, 2.0), {})
        >>> out, state = pure(*args, **kwargs)
        >>> out is None, bool((state[0]["kernel"][...] == 2 * model.kernel[...]).all())
        (True, True)

    The caller's modules are left as they were: the function updates copies.
    """
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return fn, args, kwargs
    is_node = nnx.graph.is_graph_node
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_node)
    at = [i for i, x in enumerate(leaves) if is_node(x)]
    if not at:
        return fn, args, kwargs
    graphdef, state = nnx.split([leaves[i] for i in at])
    # A node all of whose state another holds has none of its own; a node may also be a
    # Variable, whose state is a single value rather than an nnx.State.
    own = [j in state for j in range(len(at))]
    for j, i in enumerate(at):
        leaves[i] = state[j] if own[j] else nnx.State({})

    def pure(*pure_args, **pure_kwargs):
        leaves = tree.flatten_up_to((pure_args, pure_kwargs))
        state = nnx.State({j: leaves[i] for j, i in enumerate(at) if own[j]})
        nodes = nnx.merge(graphdef, state, copy=True)  # fresh Variables: the caller's stay
        for i, node in zip(at, nodes):
            leaves[i] = node
        call_args, call_kwargs = jax.tree_util.tree_unflatten(tree, leaves)
        out = fn(*call_args, **call_kwargs)
        return (out, nnx.state(nodes)) if returns_state else out

    new_args, new_kwargs = jax.tree_util.tree_unflatten(tree, leaves)
    return pure, new_args, new_kwargs


def array_function(fn: Callable, args: tuple, kwargs: dict) -> tuple[Callable, Any]:
    """:func:`jaxprs.array_function` of ``fn`` made :func:`functional`: what the FLOP tools
    trace, with a step's in-place updates among its outputs."""
    return jaxprs.array_function(*functional(fn, args, kwargs))


def refuse_if_uncounted(closed, counted: int, tool: str) -> None:
    """Raises when ``counted`` is 0 but the traced ``closed`` jaxpr has matrix products.

    Then every product is dead code (XLA drops it): the function returns
    nothing they compute, so its results went elsewhere, into a dict, a list
    or an object it closes over and updates in place. The message says to
    return them.
    """
    if counted:
        return
    traced = sum(flops for _, flops, _ in census.census(closed.jaxpr))
    if traced:
        raise ValueError(
            f"{tool} counted no FLOPs, yet the function traces {traced} FLOPs of matrix "
            "products: it returns nothing they compute, so they are dead code (XLA drops it). "
            "A step that updates state in place (a dict, a list or an object it closes over) "
            "must return that state for its products to count; Flax NNX modules and an "
            "nnx.Optimizer passed as arguments (not closed over) count with their in-place "
            "updates.")
