"""A reader of XLA's optimized HLO text: computations, instructions, and how often each runs.

:func:`parse` turns the text that ``jax.jit(f).lower(...).compile().as_text()``
returns (or an HLO dump) into a :class:`Module`: its computations, each a list
of :class:`Instruction` with the element types and dimensions of its result,
its opcode, operands and attributes. It reads only what
:mod:`jaxmp._src.gpu_program` needs and fails loudly on a line it cannot read
rather than guess.

:meth:`Module.executions` says how many times each computation runs per call
of the entry computation: a ``while`` body runs its known trip count (XLA
writes it in the loop's ``backend_config`` as ``known_trip_count``), its
condition once more; a loop whose trip count XLA does not know counts once
and is listed in :attr:`Module.unknown_trip_counts`; every branch of a
``conditional`` counts as run (an upper bound: which branch runs is known only
at run time); a fused computation runs as often as the instruction that calls
it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
import re
from typing import Iterator

# Bytes per element of HLO's element types (float8 and the 4-bit types rounded up to
# whole bytes where they pack, which XLA:GPU does not for f8).
_ELEMENT_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f4e2m1fn": 0.5, "f8e8m0fnu": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e3m4": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "token": 0,
}

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-$]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-$]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,<=]*)\]")
_OPCODE = re.compile(r"([a-z][\w\-]*)\(")
_OPERAND = re.compile(r"%([\w.\-$]+)")


def element_bytes(dtype: str) -> float:
    """Bytes per element of an HLO element type (``"bf16"`` -> 2)."""
    if dtype not in _ELEMENT_BYTES:
        raise ValueError(f"jaxmp: unknown HLO element type {dtype!r}")
    return _ELEMENT_BYTES[dtype]


def _balanced(text: str, start: int) -> int:
    """The index just past the bracket group that opens at ``text[start]``."""
    opening = text[start]
    closing = {"(": ")", "{": "}", "[": "]"}[opening]
    depth, i, quoted = 0, start, False
    while i < len(text):
        ch = text[i]
        if quoted:
            if ch == "\\":
                i += 1
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                if ch != closing:
                    raise ValueError(f"jaxmp: unbalanced brackets in HLO: {text[:200]}")
                return i + 1
        i += 1
    raise ValueError(f"jaxmp: unbalanced brackets in HLO: {text[:200]}")


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of an instruction's result: element type and dimensions."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> float:
        return self.size * element_bytes(self.dtype)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclasses.dataclass(eq=False)
class Instruction:
    """One HLO instruction: ``name = result opcode(operands), attributes``."""

    name: str
    result: tuple[Array, ...]  # one Array, or the arrays of a tuple, flattened in order
    is_tuple: bool
    opcode: str
    operands: tuple[str, ...]
    arguments: str  # inside the operand parentheses (a constant's literal, a parameter's number)
    attributes: str
    computation: str
    is_root: bool
    # The operands themselves, found by name in the same computation (None: not found).
    inputs: tuple = ()

    @property
    def parameter_number(self) -> int | None:
        """A ``parameter(N)``'s ``N``."""
        return int(self.arguments) if self.opcode == "parameter" and (
            self.arguments.strip().isdigit()) else None

    def input(self, i: int):
        """The ``i``-th operand's instruction, or ``None``."""
        return self.inputs[i] if i < len(self.inputs) else None

    @property
    def dtype(self) -> str:
        """The element type of the (first) result array."""
        return self.result[0].dtype if self.result else "token"

    @property
    def dims(self) -> tuple[int, ...]:
        return self.result[0].dims if self.result else ()

    def attribute(self, key: str) -> str | None:
        """The raw text of attribute ``key`` (``kind=kLoop`` -> ``"kLoop"``), or ``None``."""
        found = re.search(r"(?:^|[\s,])" + re.escape(key) + r"=", self.attributes)
        if found is None:
            return None
        start = found.end()
        if start < len(self.attributes) and self.attributes[start] in "{\"":
            if self.attributes[start] == "{":
                return self.attributes[start:_balanced(self.attributes, start)]
            end = start + 1
            while end < len(self.attributes) and self.attributes[end] != '"':
                end += 2 if self.attributes[end] == "\\" else 1
            return self.attributes[start + 1:end]
        end = re.search(r"[,\s]|$", self.attributes[start:]).start()
        return self.attributes[start:start + end]

    def called(self, key: str) -> list[str]:
        """The computations named by attribute ``key`` (``calls=%f`` or ``{%a, %b}``)."""
        text = self.attribute(key)
        if not text:
            return []
        return _OPERAND.findall(text) or [text.lstrip("%")]

    @functools.cached_property
    def backend_config(self) -> dict:
        """The instruction's ``backend_config`` JSON (``{}`` when absent or not JSON)."""
        text = self.attribute("backend_config")
        if not text or not text.startswith("{"):
            return {}
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return {}

    @property
    def fusion_kind(self) -> str:
        """A fusion's kind: its backend kind (``__triton_nested_gemm_fusion``) or ``kLoop``..."""
        kind = self.backend_config.get("fusion_backend_config", {}).get("kind")
        return kind or self.attribute("kind") or ""

    @property
    def custom_call_target(self) -> str:
        return self.attribute("custom_call_target") or ""

    @property
    def op_name(self) -> str:
        """The JAX operation it came from (``jit(step)/jvp()/dot_general``), from its metadata."""
        metadata = self.attribute("metadata") or ""
        found = re.search(r'op_name="((?:[^"\\]|\\.)*)"', metadata)
        return found.group(1) if found else ""

    @property
    def stack_frame(self) -> int | None:
        found = re.search(r"stack_frame_id=(\d+)", self.attribute("metadata") or "")
        return int(found.group(1)) if found else None

    def dimensions(self, key: str) -> tuple[int, ...]:
        """An integer-list attribute (``lhs_contracting_dims={1,2}`` -> ``(1, 2)``)."""
        text = self.attribute(key)
        return tuple(int(d) for d in re.findall(r"\d+", text)) if text else ()


def _parse_result(text: str) -> tuple[tuple[Array, ...], bool, str]:
    """``(arrays, is_tuple, rest)`` of an instruction's right-hand side."""
    if text.startswith("("):
        end = _balanced(text, 0)
        type_text, rest, is_tuple = text[:end], text[end:], True
    else:
        type_text, _, rest = text.partition(" ")
        is_tuple = False
    arrays = tuple(
        Array(dtype, tuple(int(d.lstrip("<=")) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(type_text))
    if not arrays and type_text.strip().startswith("token"):
        arrays = ()
    return arrays, is_tuple, rest.strip()


@dataclasses.dataclass
class Module:
    """The computations of an HLO module, by name, and where each is called from."""

    computations: dict[str, list[Instruction]]
    entry: str
    instructions: dict[str, Instruction]  # by name (XLA's names are unique in a module)
    locations: dict[int, tuple[str, int, str, int]]  # stack frame -> (file, line, function, parent)

    def root(self, computation: str) -> Instruction | None:
        for instruction in self.computations.get(computation, ()):
            if instruction.is_root:
                return instruction
        return None

    @functools.cached_property
    def callers(self) -> dict[str, Instruction]:
        """The instruction that calls each fused, loop, branch or called computation."""
        found = {}
        for instruction in self.instructions.values():
            for key in _CALLED_BY.get(instruction.opcode, ()):
                for name in instruction.called(key):
                    found.setdefault(name, instruction)
        return found

    @functools.cached_property
    def users(self) -> dict[Instruction, list[Instruction]]:
        """The instructions that take each instruction as an operand."""
        found = collections.defaultdict(list)
        for instructions in self.computations.values():
            for instruction in instructions:
                for operand in instruction.inputs:
                    if operand is not None:
                        found[operand].append(instruction)
        return found

    def argument(self, parameter: Instruction) -> Instruction | None:
        """What the instruction that calls ``parameter``'s computation (a fusion, call or async
        start) passes for it; ``None`` for the entry's parameters and loop states."""
        caller = self.callers.get(parameter.computation)
        number = parameter.parameter_number
        if caller is None or number is None or caller.opcode not in ("fusion", "call",
                                                                      "async-start"):
            return None
        return caller.input(number)

    @functools.cached_property
    def unknown_trip_counts(self) -> tuple[str, ...]:
        """The ``while`` loops whose trip count XLA does not know (counted as running once)."""
        self.executions  # pylint: disable=pointless-statement  (fills the list)
        return tuple(self._unknown)

    @functools.cached_property
    def executions(self) -> dict[str, int]:
        """How many times each computation runs per call of the entry computation.

        Only computations that launch work are listed: the entry, loop bodies and
        conditions, conditional branches, called and async computations (the
        fused computations run as their calling instruction does).
        """
        self._unknown: list[str] = []
        times: dict[str, int] = collections.Counter({self.entry: 1})
        order = [self.entry]
        for computation in order:  # grows as called computations are found
            for instruction in self.computations.get(computation, ()):
                inner = _control_calls(instruction)
                if not inner:
                    continue
                trips = 1
                if instruction.opcode == "while":
                    known = instruction.backend_config.get("known_trip_count", {}).get("n")
                    if known is None:
                        self._unknown.append(instruction.name)
                    else:
                        trips = int(known)
                for name, extra in inner:
                    runs = trips + extra if instruction.opcode == "while" else 1
                    times[name] += times[computation] * runs
                    if name not in order:
                        order.append(name)
        return dict(times)

    def location(self, instruction: Instruction, skip=lambda file_name: False) -> str:
        """``file:line (function)`` of the innermost stack frame of ``instruction`` for which
        ``skip(file)`` is false (the innermost frame when all are skipped), or ``""``."""
        frame, seen, first = instruction.stack_frame, set(), ""
        while frame is not None and frame in self.locations and frame not in seen:
            seen.add(frame)
            file_name, line, function, parent = self.locations[frame]
            text = f"{os.path.basename(file_name)}:{line} ({function})"
            first = first or text
            if not skip(file_name):
                return text
            frame = parent if parent != frame else None
        return first


# The attributes that name the computations an opcode calls.
_CALLED_BY = {
    "fusion": ("calls",), "call": ("to_apply",), "while": ("body", "condition"),
    "conditional": ("branch_computations", "true_computation", "false_computation"),
    "async-start": ("calls",), "custom-call": ("called_computations",),
}


def _control_calls(instruction: Instruction) -> list[tuple[str, int]]:
    """``(computation, extra runs)`` that ``instruction`` runs as computations of their own
    (a loop's body and condition, whose condition runs once more than the body; branches;
    called and async computations), not fused into one kernel."""
    op = instruction.opcode
    if op == "while":
        return ([(name, 0) for name in instruction.called("body")]
                + [(name, 1) for name in instruction.called("condition")])
    if op == "conditional":
        return [(name, 0) for key in _CALLED_BY["conditional"] for name in instruction.called(key)]
    if op in ("call", "async-start"):
        return [(name, 0) for key in _CALLED_BY[op] for name in instruction.called(key)]
    return []


def _parse_tables(lines: list[str]) -> dict[int, tuple[str, int, str, int]]:
    """The stack-frame tables of the module header (``FileNames`` ... ``StackFrames``)."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in lines:
        if re.match(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\s*$", line):
            current = line.strip()
            tables[current] = {}
        elif current and re.match(r"^\d+\s", line):
            number, _, rest = line.partition(" ")
            tables[current][int(number)] = rest.strip()
        elif line.strip() and current and not re.match(r"^\d+\s", line):
            current = None
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    functions = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}

    def field(text, key):
        found = re.search(key + r"=(\d+)", text)
        return int(found.group(1)) if found else 0

    places = {k: (files.get(field(v, "file_name_id"), "?"),
                  field(v, "line"), functions.get(field(v, "function_name_id"), "?"))
              for k, v in tables.get("FileLocations", {}).items()}
    return {k: (*places.get(field(v, "file_location_id"), ("?", 0, "?")),
                field(v, "parent_frame_id"))
            for k, v in tables.get("StackFrames", {}).items()}


def parse(text: str) -> Module:
    """The :class:`Module` of an optimized HLO module's text.

    Raises:
        ValueError: the text has no entry computation, or an instruction line that
            cannot be read.
    """
    computations: dict[str, list[Instruction]] = {}
    instructions: dict[str, Instruction] = {}
    entry = None
    current = None
    header: list[str] = []
    for line in text.splitlines():
        if current is None:
            found = _COMPUTATION.match(line)
            if found and not line.startswith("HloModule"):
                current = found.group(2)
                computations[current] = []
                if found.group(1):
                    entry = current
            elif not computations:
                header.append(line)
            continue
        if line.strip() == "}":
            current = None
            continue
        found = _INSTRUCTION.match(line)
        if not found:
            if line.strip():
                raise ValueError(f"jaxmp: cannot read this HLO line: {line.strip()[:200]}")
            continue
        is_root, name, rhs = bool(found.group(1)), found.group(2), found.group(3)
        result, is_tuple, rest = _parse_result(rhs)
        opcode = _OPCODE.match(rest)
        if opcode is None:
            raise ValueError(f"jaxmp: cannot read this HLO instruction: {line.strip()[:200]}")
        start = opcode.end() - 1
        end = _balanced(rest, start)
        arguments = rest[start + 1:end - 1]
        instruction = Instruction(
            name=name, result=result, is_tuple=is_tuple, opcode=opcode.group(1),
            operands=tuple(_OPERAND.findall(arguments)), arguments=arguments,
            attributes=rest[end:].lstrip(", "), computation=current, is_root=is_root)
        computations[current].append(instruction)
        instructions[name] = instruction
    if entry is None:
        raise ValueError("jaxmp: this text has no ENTRY computation: is it an optimized HLO "
                         "module (compiled.as_text())?")
    for body in computations.values():  # names are resolved within their computation
        scope = {instruction.name: instruction for instruction in body}
        for instruction in body:
            instruction.inputs = tuple(scope.get(name) for name in instruction.operands)
    return Module(computations, entry, instructions, _parse_tables(header))


def walk(module: Module, computation: str) -> Iterator[Instruction]:
    """The instructions of ``computation`` and of the computations it fuses, nested ones too."""
    for instruction in module.computations.get(computation, ()):
        yield instruction
        if instruction.opcode == "fusion":
            for name in instruction.called("calls"):
                yield from walk(module, name)
