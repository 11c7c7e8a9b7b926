"""Which primitive autocast runs in which precision: ``AutocastRules`` and its default sets.

Each kind of rule is a plain set of primitive names (the tables themselves live
in ``compat.py``):

* ``low_precision`` (matrix products, convolutions): operands are cast to the
  compute dtype, and so is the result;
* ``full_precision`` (sums, products, cumulative sums, exp/log and friends,
  powers, square roots, ...): floating operands are cast up to float32 and the
  result is float32;
* ``bounded`` (tanh, logistic): like ``follow``, but a float32 operand is
  narrowed to the compute dtype first (the result is bounded anyway);
* ``follow`` (elementwise arithmetic, comparisons, reshapes, slices, max/min
  reductions, ...): operands are brought to one common dtype, the narrowest of
  them, so a float32 bias, scale or positional embedding added to a
  half-precision activation is cast down instead of pulling the activation
  back to float32;
* ``passthrough`` (collectives, sharding annotations, sorts, barriers): every
  operand keeps its own dtype;
* anything else runs exactly as written, on operands cast back to the dtypes
  the original program gave them.

This module is data and its validation only: ``AutocastRules.kind`` names the
kind of a primitive; ``interpreter.py`` runs each kind, ``analysis.py`` reads
the kinds to decide what stays wide, and ``recompute.py`` saves the
``low_precision`` products of a recomputed region.
"""

from __future__ import annotations

import dataclasses

from jaxmp._src import compat

# The primitive-name tables live in compat.py, with every other contact with JAX.
LOW_PRECISION = compat.LOW_PRECISION  # run in the compute dtype
FULL_PRECISION = compat.FULL_PRECISION  # run in (at least) float32
FOLLOW = compat.FOLLOW  # run in the narrowest floating dtype of their operands
BOUNDED = compat.BOUNDED  # saturating: a kept operand is narrowed first
PASSTHROUGH = compat.PASSTHROUGH  # each operand keeps its own dtype

_RULE_FIELDS = ("low_precision", "full_precision", "follow", "passthrough", "bounded")
_DEFAULT_SETS = {"low_precision": LOW_PRECISION, "full_precision": FULL_PRECISION,
                 "follow": FOLLOW, "passthrough": PASSTHROUGH, "bounded": BOUNDED}
_SET_NAMES = {"low_precision": "LOW_PRECISION", "full_precision": "FULL_PRECISION",
              "follow": "FOLLOW", "passthrough": "PASSTHROUGH", "bounded": "BOUNDED"}


def _describe(field: str, names: frozenset) -> str:
    """A short expression for a rule set, relative to its default."""
    default = _DEFAULT_SETS[field]
    added, removed = sorted(names - default), sorted(default - names)
    if len(added) + len(removed) > 6:
        return f"<{len(names)} name{'' if len(names) == 1 else 's'}>"
    text = _SET_NAMES[field]
    if added:
        text += " | {" + ", ".join(repr(n) for n in added) + "}"
    if removed:
        text += " - {" + ", ".join(repr(n) for n in removed) + "}"
    return text


@dataclasses.dataclass(frozen=True)
class AutocastRules:
    """Which primitives :func:`jaxmp.autocast` runs in which precision.

    Each field is a set of primitive names (``jax.make_jaxpr`` shows them), one
    kind of rule: ``low_precision`` (run in the compute dtype),
    ``full_precision`` (run in float32), ``bounded`` (saturating functions
    such as ``tanh``: like ``follow``, but an operand kept in float32 is
    narrowed to the compute dtype first), ``follow`` (run in the narrowest
    dtype of their operands), ``passthrough`` (each operand keeps its dtype).
    A primitive in none of them runs as written. The defaults are
    ``jaxmp.autocast.LOW_PRECISION``, ``FULL_PRECISION``, ``BOUNDED``,
    ``FOLLOW`` and ``PASSTHROUGH``, which share no name. A primitive belongs
    to one kind (:meth:`kind`): a name added to a field takes it from the
    default set it was in, when that field is left as it is, and a name in two
    fields that were both given raises a ``ValueError``. Its ``repr`` names
    only what differs from the defaults.

    Examples:
        >>> import jaxmp
        >>> jaxmp.AutocastRules()
        AutocastRules()
        >>> rules = jaxmp.AutocastRules(full_precision=jaxmp.autocast.FULL_PRECISION | {"tanh"})
        >>> rules
        AutocastRules(full_precision=FULL_PRECISION | {'tanh'})
        >>> "tanh" in rules.full_precision
        True
    """

    low_precision: frozenset = LOW_PRECISION
    full_precision: frozenset = FULL_PRECISION
    follow: frozenset = FOLLOW
    passthrough: frozenset = PASSTHROUGH
    bounded: frozenset = BOUNDED

    def __post_init__(self):
        for field in _RULE_FIELDS:
            names = getattr(self, field)
            if isinstance(names, str) or not all(isinstance(n, str) for n in names):
                raise TypeError(
                    f"AutocastRules.{field} must be a collection of primitive names (strings), "
                    f"e.g. {{'exp', 'log'}}; got {names!r}.")
            object.__setattr__(self, field, frozenset(names))
        object.__setattr__(self, "_kinds", self._kind_table())

    def _kind_table(self) -> dict[str, str]:
        """Primitive name -> the field that holds it. A name in a field the user set and in a
        default set left as it is belongs to the user's; in two fields the user set, it is
        an error (which should win is not for jaxmp to guess)."""
        table: dict[str, str] = {}
        for field in _RULE_FIELDS:
            for name in getattr(self, field):
                other = table.get(name)
                if other is None:
                    table[name] = field
                    continue
                mine, theirs = (getattr(self, f) != _DEFAULT_SETS[f] for f in (field, other))
                if mine and theirs:
                    raise ValueError(
                        f"AutocastRules: {name!r} is in both {other} and {field}; a primitive "
                        f"runs one way. Remove it from one of them, e.g. "
                        f"{field}=jaxmp.autocast.{_SET_NAMES[field]} | {{...}} without "
                        f"{name!r}, or {other}=... - {{{name!r}}}.")
                if mine:
                    table[name] = field
        return table

    def kind(self, primitive: str) -> str | None:
        """The field that holds ``primitive`` (``"low_precision"``, ...), or ``None``.

        Examples:
            >>> import jaxmp
            >>> jaxmp.AutocastRules().kind("dot_general")
            'low_precision'
            >>> jaxmp.AutocastRules(follow=jaxmp.autocast.FOLLOW | {"tanh"}).kind("tanh")
            'follow'
        """
        return self._kinds.get(primitive)

    def __repr__(self) -> str:
        changed = [f"{f}={_describe(f, getattr(self, f))}" for f in _RULE_FIELDS
                   if getattr(self, f) != _DEFAULT_SETS[f]]
        return f"AutocastRules({', '.join(changed)})"

