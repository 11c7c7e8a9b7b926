"""The row type of the float8 recipe table: what one recipe quantises, with which scales,
which state it carries, where it runs natively and what runs instead elsewhere.

Each recipe module (``tensor.py``, ``mxfp8.py``) defines its row, ``RECIPE``;
``table.py`` collects them into :data:`jaxmp._src.float8.RECIPES`. A new
recipe is a new module with its row, and one line in ``table.py``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple


class StateSpec(NamedTuple):
    """The state a recipe carries from one step to the next, and how autocast hands it out.

    Attributes:
        type: the state's pytree class (``delayed.Float8State``).
        check: ``check(value)``: the state a user passed, checked (an error saying the fix).
        session: ``session(history, margin)``: a context in which the recipe's products
            read their rows of ``history`` (``None``: count the products); yields an
            object whose ``count`` is the number of products traced.
        empty: ``empty(products, window, margin)``: the state with nothing recorded.
        update: ``update(state, grad)``: the state after a step, from the gradient of the
            loss with respect to the state (which the recipe's backward pass fills).
    """

    type: type
    check: Callable
    session: Callable
    empty: Callable
    update: Callable


class Recipe(NamedTuple):
    """One way of scaling the float8 products of ``autocast``: a row of :data:`RECIPES`.

    Attributes:
        name: its ``float8_scaling`` name.
        matmul_dtypes: what it quantises into: the ``matmul_dtype`` values it
            takes.
        block: its scales: elements per scale along the contracting dimension
            of the products it block-scales; 0 for one scale per tensor.
        blocked: the primitives it block-scales; the others (convolutions
            under ``"mxfp8"``) run with one scale per tensor.
        dot: ``dot(a, b, *, dimension_numbers, matmul_dtype, out_dtype)``, the
            scaled ``dot_general`` with its float8 backward products.
        conv: ``conv(a, b, *, params, matmul_dtype, out_dtype)``, the same for
            ``conv_general_dilated``.
        summary: what it does, for error messages.
        fallback: the recipe run instead on accelerators without its GEMMs
            (:func:`recipe_for`); ``None`` for a recipe that runs everywhere.
        native: ``native(target)``: whether a :class:`target.Target` runs its
            products natively (:func:`target.block_scaled_gemms` for
            ``"mxfp8"``); asked of a recipe with a ``fallback`` only, ``None``
            for one that runs everywhere.
        state: what it carries from one step to the next: ``None`` for every
            recipe but ``"delayed"``, whose scales come from the tensors
            themselves, in the step that uses them (current scaling); for
            ``"delayed"``, a :class:`StateSpec` of its amax history.
        rules: the :class:`rules.Float8Rules` autocast uses when it is given no
            ``float8_rules`` (``None``: ``Float8Rules()``, every product);
            autocast says once which products they keep.
    """

    name: str
    matmul_dtypes: tuple
    block: int
    blocked: frozenset
    dot: Callable
    conv: Callable
    summary: str
    fallback: str | None = None
    native: Callable | None = None
    state: Any = None
    rules: Any = None
