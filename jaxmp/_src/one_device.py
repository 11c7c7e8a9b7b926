"""A ``shard_map`` (and so a ``pmap``) as one program on one device: its body under ``vmap``s.

:func:`jaxmp.debug.find_nonfinite` evaluates a step one operation at a time, on
concrete arrays. A step mapped over devices binds its axes only inside the
mapping, where every value is traced, so that evaluation cannot look inside
it. This module rewrites a ``shard_map`` equation (``jax.pmap`` is one too) as
a program over the global arrays: each manual mesh axis becomes a ``vmap``
with the same name and size, so a collective keeps its meaning (a ``psum``
over an axis is a sum over the vmapped dimension), and the body, traced under
those ``vmap``s, has no named axis left. Its equations carry the source of the
equations they come from (the user's lines and names).

Each operand is split into its devices' blocks, stacked on leading dimensions
(one per manual mesh axis that splits it, in mesh order); each result is put
back together from its blocks by its ``out_specs`` (an axis an output is not
split over holds equal blocks: the first is taken).

The types of ``shard_map``'s varying-axes checks (``pvary``,
``psum_invariant``, ``all_gather_invariant``) have no meaning outside it: they
are evaluated as the identity, ``psum`` and ``all_gather``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxmp._src import compat
from jaxmp._src import interpret


def _names(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


class _Layout(NamedTuple):
    """How one operand or result is split: per dimension, the manual axes that split it."""

    dims: tuple[tuple[str, ...], ...]

    @property
    def axes(self) -> frozenset:
        return frozenset(a for names in self.dims for a in names)


class Batched(NamedTuple):
    """A ``shard_map`` equation as one program over its devices' stacked blocks.

    Attributes:
        jaxpr: the body under one ``vmap`` per manual axis (a ``ClosedJaxpr``
            without named axes): it takes :meth:`split` operands and returns
            results that :meth:`merge` puts together.
        axes: the manual mesh axes, in mesh order.
        sizes: mesh axis name -> size.
        ins, outs: the layouts of the operands and results.
    """

    jaxpr: Any
    axes: tuple[str, ...]
    sizes: dict
    ins: tuple[_Layout, ...]
    outs: tuple[_Layout, ...]

    def split(self, i: int, x: jax.Array) -> jax.Array:
        """Operand ``i`` (a global array) as its blocks, stacked on leading dimensions."""
        layout = self.ins[i]
        shape, where = [], {}
        for n, names in zip(x.shape, layout.dims):
            for a in names:
                where[a] = len(shape)
                shape.append(self.sizes[a])
            shape.append(n // math.prod(self.sizes[a] for a in names))
        lead = [where[a] for a in self.axes if a in where]
        rest = [d for d in range(len(shape)) if d not in lead]
        return jnp.transpose(jnp.reshape(x, shape), lead + rest)

    def merge(self, i: int, y: jax.Array) -> jax.Array:
        """Result ``i`` (its blocks stacked on one leading dimension per manual axis) as a
        global array."""
        layout = self.outs[i]
        y = y[tuple(slice(None) if a in layout.axes else 0 for a in self.axes)]
        lead = [a for a in self.axes if a in layout.axes]
        block = y.shape[len(lead):]
        order = []
        for d, names in enumerate(layout.dims):
            order += [lead.index(a) for a in names] + [len(lead) + d]
        return jnp.reshape(jnp.transpose(y, order),
                           [n * math.prod(self.sizes[a] for a in names)
                            for n, names in zip(block, layout.dims)])


class _Unvarying(interpret.Interpreter):
    """Re-traces a ``shard_map`` body with its varying-axes types dropped (see the module)."""

    def first_order(self, eqn, invals):
        name = eqn.primitive.name
        if name in compat.UNVARYING and compat.UNVARYING[name] is None:  # pvary, pbroadcast
            return list(invals)
        if name == "psum_invariant":
            with interpret.at_source_of(eqn):
                return list(jax.lax.psum(tuple(invals), compat.psum_axes(eqn)))
        if name == "all_gather_invariant":
            p = compat.all_gather(eqn)
            with interpret.at_source_of(eqn):
                return [jax.lax.all_gather(invals[0], p.axis_name,
                                           axis=p.dimension, tiled=p.tiled)]
        return interpret.bind(eqn, invals)


def as_batched(eqn) -> Batched:
    """The ``shard_map`` equation ``eqn`` as one program on one device (see the module)."""
    params = compat.shard_map(eqn)
    manual = params.manual_axes
    mesh = params.mesh
    axes = tuple(a for a in mesh.axis_names if a in manual)
    sizes = dict(mesh.shape)

    def layouts(specs, variables) -> tuple[_Layout, ...]:
        out = []
        for spec, v in zip(specs, variables):
            entries = tuple(spec) + (None,) * (v.aval.ndim - len(spec))
            out.append(_Layout(tuple(tuple(a for a in _names(e) if a in manual)
                                     for e in entries)))
        return tuple(out)

    ins = layouts(params.in_specs, eqn.invars)
    outs = layouts(params.out_specs, eqn.outvars)
    body = compat.closed(params.body)
    consts = body.consts
    body = body.jaxpr

    def fn(*xs):
        return _Unvarying().eval_jaxpr(body, consts, list(xs))

    for a in reversed(axes):
        fn = jax.vmap(fn, in_axes=tuple(0 if a in layout.axes else None for layout in ins),
                      axis_name=a, axis_size=sizes[a])
    blocks = [jax.ShapeDtypeStruct(
        tuple(sizes[a] for a in axes if a in layout.axes) + tuple(v.aval.shape), v.aval.dtype)
        for layout, v in zip(ins, body.invars)]
    return Batched(jax.make_jaxpr(fn)(*blocks), axes, sizes, ins, outs)

