"""Mixed-precision policies: which dtype parameters, computation and outputs use."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxmp._src import casting

PyTree = Any

_DTYPE_NAMES = {
    "float32": jnp.float32,
    "f32": jnp.float32,
    "full": jnp.float32,  # what jmp writes for float32: str(jmp.get_policy("c=bf16"))
    "float16": jnp.float16,
    "f16": jnp.float16,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float64": jnp.float64,
    "f64": jnp.float64,
}
# jmp also reads "half", as bfloat16 on a TPU and float16 elsewhere. jaxmp does
# not: the same string would give different policies on different machines, and
# the two dtypes need different loss scaling. jmp never writes "half" itself.
_NOT_A_DTYPE = {
    "half": "jaxmp has no backend-dependent half dtype (jmp reads 'half' as bfloat16 on "
            "TPU and float16 elsewhere); write f16 or bf16",
}
_FIELD_NAMES = {
    "params": "param_dtype",
    "p": "param_dtype",
    "compute": "compute_dtype",
    "c": "compute_dtype",
    "output": "output_dtype",
    "o": "output_dtype",
}


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype a model keeps its parameters in, computes in and returns.

    A policy is a plain, hashable value: pass it around, close over it, or hand
    it to Haiku's ``hk.mixed_precision.set_policy``, which calls the three
    ``cast_to_*`` methods.

    Attributes:
        param_dtype: dtype of the stored parameters (usually float32).
        compute_dtype: dtype of the forward and backward computation.
        output_dtype: dtype of the outputs.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> policy = jaxmp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
        >>> policy.cast_to_compute({"x": jnp.ones(2)})["x"].dtype
        dtype(bfloat16)
        >>> policy.cast_to_output(policy.cast_to_compute(jnp.ones(2))).dtype
        dtype('float32')
    """

    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            dt = casting.canonical_float_dtype(getattr(self, field), what=field)
            object.__setattr__(self, field, dt)

    def cast_to_param(self, tree: PyTree) -> PyTree:
        """Casts the floating-point leaves of ``tree`` to ``param_dtype``."""
        return casting.cast_tree(tree, self.param_dtype)

    def cast_to_compute(self, tree: PyTree) -> PyTree:
        """Casts the floating-point leaves of ``tree`` to ``compute_dtype``."""
        return casting.cast_tree(tree, self.compute_dtype)

    def cast_to_output(self, tree: PyTree) -> PyTree:
        """Casts the floating-point leaves of ``tree`` to ``output_dtype``."""
        return casting.cast_tree(tree, self.output_dtype)

    def with_param_dtype(self, dtype: Any) -> "Policy":
        """This policy with another ``param_dtype``."""
        return dataclasses.replace(self, param_dtype=dtype)

    def with_compute_dtype(self, dtype: Any) -> "Policy":
        """This policy with another ``compute_dtype``."""
        return dataclasses.replace(self, compute_dtype=dtype)

    def with_output_dtype(self, dtype: Any) -> "Policy":
        """This policy with another ``output_dtype``."""
        return dataclasses.replace(self, output_dtype=dtype)

    def __str__(self) -> str:
        return (f"params={np.dtype(self.param_dtype).name},"
                f"compute={np.dtype(self.compute_dtype).name},"
                f"output={np.dtype(self.output_dtype).name}")


def _parse_dtype(name: str, spec: str) -> Any:
    key = name.strip().lower()
    if key in _DTYPE_NAMES:
        return _DTYPE_NAMES[key]
    if key in _NOT_A_DTYPE:
        raise ValueError(f"Unknown dtype {name.strip()!r} in policy {spec!r}: {_NOT_A_DTYPE[key]}.")
    known = ", ".join(sorted(_DTYPE_NAMES))
    raise ValueError(f"Unknown dtype {name.strip()!r} in policy {spec!r}; known dtypes: {known}.")


def get_policy(spec: str | Policy) -> Policy:
    """Parses a policy string in jmp's format.

    The string is a comma-separated list of ``name=dtype`` pairs, with names
    ``params``, ``compute`` and ``output`` (short forms ``p``, ``c``, ``o``) and
    dtypes ``float32``, ``float16``, ``bfloat16`` (``f32``, ``f16``, ``bf16``;
    ``full`` is float32, as jmp writes it, and ``float64``/``f64`` are read
    too). Parameters default to float32, computation to the parameter dtype and
    the output to the compute dtype. A bare dtype sets all three. Every string
    that ``str(jmp.get_policy(...))`` produces is accepted.

    jmp's ``half`` is rejected: jmp reads it as bfloat16 on a TPU and float16
    elsewhere, so one string would mean two policies depending on the machine,
    and float16 needs loss scaling where bfloat16 does not. jaxmp keeps no
    global or backend-dependent dtype; write ``f16`` or ``bf16``. (jmp never
    writes ``half`` itself: its ``str`` names the concrete dtype.)

    Args:
        spec: the policy string, or a :class:`Policy` (returned unchanged).

    Raises:
        ValueError: if a name or a dtype is unknown, or a name is repeated.

    Examples:
        >>> import jaxmp
        >>> jaxmp.get_policy("params=float32,compute=bfloat16,output=float32")
        Policy(param_dtype=dtype('float32'), compute_dtype=dtype(bfloat16), output_dtype=dtype('float32'))
        >>> str(jaxmp.get_policy("p=f32,c=f16"))
        'params=float32,compute=float16,output=float16'
        >>> str(jaxmp.get_policy("p=full,c=bf16,o=bf16"))  # as jmp writes it
        'params=float32,compute=bfloat16,output=bfloat16'
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"A policy must be a string or a Policy, got {type(spec).__name__}.")
    if "=" not in spec:
        dtype = _parse_dtype(spec, spec)
        return Policy(dtype, dtype, dtype)
    fields: dict[str, Any] = {}
    for part in spec.split(","):
        if "=" not in part:
            raise ValueError(f"Expected name=dtype in policy {spec!r}, got {part.strip()!r}.")
        name, value = part.split("=", 1)
        key = name.strip().lower()
        if key not in _FIELD_NAMES:
            raise ValueError(
                f"Unknown policy field {name.strip()!r} in {spec!r}; "
                "expected params/p, compute/c or output/o."
            )
        field = _FIELD_NAMES[key]
        if field in fields:
            raise ValueError(f"Policy field {name.strip()!r} is given twice in {spec!r}.")
        fields[field] = _parse_dtype(value, spec)
    param = fields.get("param_dtype", jnp.float32)
    compute = fields.get("compute_dtype", param)
    output = fields.get("output_dtype", compute)
    return Policy(param, compute, output)
