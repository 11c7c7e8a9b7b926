"""Where a traced product will run, and which GPUs run which float8 GEMMs natively.

:func:`compile_target` reads the device from the operands' shardings (or the
default backend); :func:`describe` names it as messages do;
:func:`block_scaled_gemms` says whether it has cuDNN's block-scaled dot. A
recipe's ``native`` field is one of these predicates.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, NamedTuple

import jax


class Target(NamedTuple):
    """The device a traced product is compiled for, as far as tracing can tell.

    Attributes:
        platform: ``"gpu"``, ``"cpu"``, ``"tpu"``...
        kind: the device kind (``"NVIDIA H100 80GB HBM3"``, ``"NVIDIA B200"``).
        capability: the CUDA compute capability (``"9.0"``) when a device
            object says it; ``None`` when only the device kind is known.
    """

    platform: str
    kind: str
    capability: str | None


def _abstract_platform(device: Any) -> str | None:
    """The platform of an abstract mesh's device, or ``None`` when it cannot be told.

    JAX's abstract devices name their platform from jax 0.9 on; before, only
    their kind, from which the platform of a CPU, an NVIDIA GPU or a TPU is read.
    """
    platform = getattr(device, "platform", None)
    if platform:
        return platform
    kind = str(getattr(device, "device_kind", "")).lower()
    if kind == "cpu":
        return "cpu"
    if "nvidia" in kind:
        return "gpu"
    if "tpu" in kind:
        return "tpu"
    return None


def compile_target(avals: Iterable[Any]) -> Target:
    """Where a product with operands of these abstract values will run.

    The device of the operands' shardings when they have one: ``jit`` with
    sharded arguments, and deviceless ahead-of-time compilation, whose
    arguments (``jax.ShapeDtypeStruct(..., sharding=NamedSharding(mesh,
    ...))`` over a ``jax.experimental.topologies`` topology's devices) carry
    the target's device kind in their types. Else the first device of the
    default backend, where ``jit`` compiles unsharded arguments.
    """
    for aval in avals:
        mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
        device = getattr(mesh, "abstract_device", None)
        platform = _abstract_platform(device) if device is not None else None
        if platform is not None:
            return Target(platform, device.device_kind, None)
    device = jax.devices()[0]
    return Target(device.platform, device.device_kind,
                  getattr(device, "compute_capability", None))


# CUDA compute capabilities of GPUs by device kind, for targets known by their kind alone.
_CAPABILITIES = (
    (re.compile(r"\bG?B(100|200|300)\b|Blackwell|\bGB10\b|RTX 50\d0", re.I), "10.0"),
    (re.compile(r"\bG?H(100|200|800|20)\b", re.I), "9.0"),
    (re.compile(r"\bL4\b|\bL40|RTX 40\d0|\bAda\b", re.I), "8.9"),
    (re.compile(r"\bA(100|800|30|10|40)\b|RTX 30\d0|A6000", re.I), "8.0"),
)
_GENERATIONS = {"12": "Blackwell", "10": "Blackwell", "9": "Hopper", "8.9": "Ada Lovelace",
                "8": "Ampere", "7.5": "Turing", "7": "Volta"}


def _capability(target: Target) -> str | None:
    if target.platform != "gpu":
        return None
    if target.capability is not None:
        return target.capability
    return next((cc for pattern, cc in _CAPABILITIES if pattern.search(target.kind)), None)


def describe(target: Target) -> str:
    """``target`` as a message names it: ``NVIDIA H100 80GB HBM3 (Hopper, sm_90)``."""
    cc = _capability(target)
    if cc is None:
        return target.kind or target.platform
    major = cc.split(".")[0]
    generation = _GENERATIONS.get(cc, _GENERATIONS.get(major))
    sm = "sm_" + cc.replace(".", "")
    return f"{target.kind} ({generation + ', ' if generation else ''}{sm})"


def block_scaled_gemms(target: Target) -> bool:
    """Whether ``target`` runs cuDNN's block-scaled dot (``jax.nn.scaled_matmul``) natively.

    XLA's GPU compiler gives the block-scaled dot to cuDNN on NVIDIA GPUs of
    compute capability 10.0 and up (Blackwell, with cuDNN 9.7 or newer) and
    otherwise expands it into converts and a float32 ``dot`` that its loop
    emitter runs without tensor cores.
    """
    cc = _capability(target)
    try:
        return cc is not None and int(cc.split(".")[0]) >= 10
    except ValueError:  # not a CUDA capability (ROCm's gfx names)
        return False
