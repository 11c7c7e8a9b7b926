"""What an NVIDIA GPU runs: a step compiled for H100 or B200 without a GPU, and its census.

jaxmp's other measures (:func:`jaxmp.debug.matmul_flops` and the shares built on it)
count the program *before* XLA optimises it: what jaxmp asked for. XLA's GPU
compiler then chooses how each product runs (a cuBLAS or cuDNN library call, a
Triton GEMM, or a ``dot`` inside a loop fusion that runs without tensor cores),
may widen float8 operands before the product, and fuses everything else into
kernels. :func:`gpu_program` runs that compiler for a GPU target on any machine
(deviceless ahead-of-time compilation through JAX's CUDA plugin; no GPU and no
driver needed) and reads the optimized program:

* every matrix product and convolution: how it is compiled, its operand types
  *as executed* (``f32<-f8e4m3fn``: a float8 tensor converted to float32 before
  the product), its FLOPs and how often it runs;
* every kernel launched (the fusions, library calls and copies of the entry
  computation, of loop bodies and of called computations), the bytes it writes
  (its results; a library call's workspace is left out; an in-place
  dynamic-update-slice writes its update) and reads (its operands; a fused
  parameter that is only sliced or gathered reads what the slices take);
* XLA's scratch memory (``temp``) from the compiled program's memory analysis;
* an estimate of the step time: per kernel ``max(FLOPs / rate, bytes /
  bandwidth) + launch``, summed over launches (see :class:`GpuTarget`).

A loop (``while``) counts its body once per iteration where XLA knows the trip
count (``known_trip_count``), once otherwise (listed in
:attr:`GpuProgram.unknown_trip_counts`); a ``conditional`` counts every branch
(an upper bound).

Without autotuning (there is no GPU to time candidates on) XLA picks its
default for each GEMM (mostly Triton GEMM fusions); a GPU may choose cuBLAS for
some. The choice between library and Triton does not change the operand types,
the FLOPs or the float8 share; it moves a few kernels and bytes.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import importlib.resources
import math
import re
from typing import Any, Callable, Mapping, NamedTuple

from jaxmp._src import hlo
from jaxmp._src import lowered_flops
from jaxmp._src import messages
from jaxmp._src import source

# --- Targets ---------------------------------------------------------------------------------


class GpuTarget(NamedTuple):
    """A GPU that :func:`jaxmp.debug.gpu_program` compiles for, and the rates its estimate uses.

    Attributes:
        name: the short name (``"h100"``, ``"b200"``).
        description: the card and its compute capability.
        config: the XLA GPU target config (text protobuf) shipped with jaxmp.
        rates: dense peak FLOP/s by the unit a product runs on: ``"f4"`` (float4
            tensor cores, Blackwell's; a target without them runs none), ``"f8"`` (float8
            tensor cores), ``"f16"`` (bfloat16/float16 tensor cores), ``"tf32"``
            (float32 products at XLA's default precision), ``"f32"`` (CUDA cores:
            float32 at the highest precision, and every product a loop fusion
            runs), ``"f64"``.
        bandwidth: HBM bandwidth in bytes per second (the config's).
        source: where the rates come from.

    Examples:
        >>> import jaxmp
        >>> h100 = jaxmp.debug.GpuTarget.named("h100")
        >>> h100.description, round(h100.rates["f8"] / h100.rates["f16"], 2)
        ('NVIDIA H100 SXM (sm_90)', 2.0)
        >>> # An H200 is an H100 (sm_90) with 4.8 TB/s: the same program, another estimate.
        >>> h200 = h100._replace(name="h200", description="NVIDIA H200 (sm_90)", bandwidth=4.8e12)
    """

    name: str
    description: str
    config: str
    rates: Mapping[str, float]
    bandwidth: float
    source: str

    @classmethod
    def named(cls, name: str) -> "GpuTarget":
        """The target shipped with jaxmp under ``name``: ``"h100"`` or ``"b200"``."""
        return get_target(name)


# What the estimate assumes a kernel achieves, calibrated on the step times measured on
# an NVIDIA H100 80GB HBM3 (jax 0.11.2, CUDA 13.0, cuDNN 9.19) for the programs that GPU
# compiled (benchmarks/README.md, "What the GPU runs"): a share of the peak rates and of
# the bandwidth, and a fixed cost per kernel launch.
ACHIEVED_RATE = 0.6
ACHIEVED_BANDWIDTH = 0.8
LAUNCH_SECONDS = 3e-6


def _config(name: str) -> str:
    return (importlib.resources.files("jaxmp._src") / "targets" / f"{name}.txtpb").read_text()


def _config_bandwidth(config: str) -> float:
    found = re.search(r"memory_bandwidth:\s*(\d+)", config)
    if found is None:
        raise ValueError("jaxmp: the target config names no memory_bandwidth")
    return float(found.group(1))


@functools.lru_cache(maxsize=None)
def _target(name: str) -> GpuTarget:
    row = _TARGETS[name]
    config = _config(name)
    return GpuTarget(name, row["description"], config, row["rates"], _config_bandwidth(config),
                     row["source"])


# One row per target: the rates are dense (no 2:4 sparsity) peaks of the SXM parts.
_TARGETS = {
    "h100": {
        "description": "NVIDIA H100 SXM (sm_90)",
        "rates": {"f8": 1979e12, "f16": 989e12, "tf32": 495e12, "f32": 67e12, "f64": 67e12},
        "source": "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (dense: half the "
                  "sparsity figures): https://www.nvidia.com/en-us/data-center/h100/",
    },
    "b200": {
        "description": "NVIDIA B200 (sm_100)",
        "rates": {"f4": 9000e12, "f8": 4500e12, "f16": 2250e12, "tf32": 1100e12, "f32": 75e12,
                  "f64": 37e12},
        "source": "NVIDIA HGX B200 specifications, per GPU, dense (half the sparsity "
                  "figures): https://www.nvidia.com/en-us/data-center/hgx/ ; also "
                  "https://glennklockwood.com/garden/processors/B200",
    },
}

TARGETS = tuple(_TARGETS)


def get_target(name: str | GpuTarget) -> GpuTarget:
    """The :class:`GpuTarget` named ``name`` (``"h100"``, ``"b200"``), or ``name`` itself."""
    if isinstance(name, GpuTarget):
        return name
    if not isinstance(name, str) or name.lower() not in _TARGETS:
        raise ValueError(f"jaxmp: unknown GPU target {name!r}; the targets are "
                         f"{', '.join(map(repr, _TARGETS))} (or a jaxmp.debug.GpuTarget)")
    return _target(name.lower())


# --- Products --------------------------------------------------------------------------------

_FLOAT_BITS = {"f64": 64, "f32": 32, "bf16": 16, "f16": 16, "f8e4m3fn": 8, "f8e5m2": 8,
               "f8e4m3": 8, "f8e3m4": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8, "f8e4m3b11fnuz": 8,
               "f4e2m1fn": 4}
_NUMPY_NAMES = {"f64": "float64", "f32": "float32", "bf16": "bfloat16", "f16": "float16",
                "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2", "f4e2m1fn": "float4_e2m1fn"}


def _is_float8(dtype: str) -> bool:
    """Float8, or float4 (NVFP4's elements): the scaled formats, counted together."""
    return dtype.startswith(("f8", "f4")) and dtype != "f8e8m0fnu"


class Product(NamedTuple):
    """One matrix product or convolution of the optimized program.

    Attributes:
        name: the HLO instruction (a custom call, or the ``dot`` inside a fusion).
        kind: ``"dot"``, ``"block-scaled dot"``, ``"convolution"`` (forward),
            ``"convolution input gradient"`` or ``"convolution kernel gradient"``.
        engine: what runs it: ``"cuBLAS"``, ``"cuDNN"``, ``"Triton"``
            (a Triton GEMM fusion), ``"cuDNN fusion"`` or ``"loop"`` (a ``dot``
            or ``convolution`` inside a loop/input fusion, or unfused: XLA's loop
            emitter, no tensor cores).
        call: the custom-call target or fusion kind, verbatim
            (``__cublas$lt$matmul$f8``, ``__triton_nested_gemm_fusion``, ``kLoop``).
        lhs: the left operand's element type as the product takes it;
            ``"f32<-f8e4m3fn"`` when a float8 (or other narrower) tensor was
            converted to it on the way.
        rhs: the right operand's, likewise.
        out: the result's element type.
        flops: 2 x multiply-adds of one execution, as executed (zero padding and
            the zeros of a dilated input included).
        runs: executions per step (loop trip counts included).
        op_name: the JAX operation it comes from (``jit(step)/jvp()/dot_general``).
        location: the user's ``file:line (function)``, from the program's metadata.
        precision: ``"highest"`` when the product asks float32's full precision.

    Examples:
        >>> import jaxmp
        >>> product = jaxmp.debug.Product(
        ...     "gemm", "dot", "cuBLAS", "__cublas$lt$matmul", "bf16", "bf16", "f32",
        ...     flops=65536, runs=1, op_name="jit(step)/dot_general", location="")
        >>> product.tensor_cores, product.dtype_key
        (True, 'bfloat16')
    """

    name: str
    kind: str
    engine: str
    call: str
    lhs: str
    rhs: str
    out: str
    flops: int
    runs: int
    op_name: str
    location: str
    precision: str = "default"

    @property
    def operands(self) -> tuple[str, str]:
        """The element types the product runs on (``"f32"`` for ``"f32<-f8e4m3fn"``)."""
        return self.lhs.split("<-")[0], self.rhs.split("<-")[0]

    @property
    def float8_native(self) -> bool:
        """Whether it runs on float8 operands on tensor cores."""
        return self.tensor_cores and all(_is_float8(d) for d in self.operands)

    @property
    def widened(self) -> bool:
        """Whether an operand was converted from a narrower float type before the product."""
        return "<-" in self.lhs or "<-" in self.rhs

    @property
    def widened_from_float8(self) -> bool:
        return any(_is_float8(t.split("<-")[1]) for t in (self.lhs, self.rhs) if "<-" in t)

    @property
    def tensor_cores(self) -> bool:
        return self.engine != "loop"

    @property
    def unit(self) -> str:
        """The rate it runs at, a key of :attr:`GpuTarget.rates`."""
        lhs, rhs = self.operands
        if not self.tensor_cores:
            return "f64" if "f64" in (lhs, rhs) else "f32"
        bits = max(_FLOAT_BITS.get(lhs, 32), _FLOAT_BITS.get(rhs, 32))
        if bits <= 4:
            return "f4"
        if bits <= 8:
            return "f8"
        if bits <= 16:
            return "f16"
        if bits == 64:
            return "f64"
        return "f32" if self.precision == "highest" else "tf32"

    @property
    def how(self) -> str:
        """How it is compiled, in words (``"cuBLAS __cublas$lt$matmul$f8"``, ``"a kLoop fusion
        (no tensor cores)"``)."""
        if self.engine == "loop":
            where = "unfused" if self.call == "unfused" else f"a {self.call} fusion"
            return f"{where} (no tensor cores)"
        return f"{self.engine} {self.call}"

    @property
    def key(self) -> str:
        """``"how [lhs x rhs -> out]"``: products alike share it."""
        return f"{self.how} [{_short(self.lhs)} x {_short(self.rhs)} -> {_short(self.out)}]"

    @property
    def dtype_key(self) -> str:
        """The operand-dtype key of :func:`jaxmp.debug.matmul_flops` for the types as executed; a
        product without tensor cores counts as ``"float32"`` (``"float64"``), the arithmetic
        the loop emitter runs it in."""
        if not self.tensor_cores:
            return "float64" if "f64" in self.operands else "float32"
        lhs, rhs = (_NUMPY_NAMES.get(d, d) for d in self.operands)
        return lowered_flops.product_key(lhs, rhs)


def _short(dtype: str) -> str:
    return (dtype.replace("f8e4m3fn", "e4m3").replace("f8e5m2", "e5m2")
            .replace("f8e8m0fnu", "e8m0").replace("f4e2m1fn", "e2m1"))


_GEMM_CALLS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")
_CONV_CALLS = {
    "__cudnn$convForward": "convolution",
    "__cudnn$convBiasActivationForward": "convolution",
    "__cudnn$convForwardGraph": "convolution",
    "__cudnn$convBackwardInput": "convolution input gradient",
    "__cudnn$convBackwardFilter": "convolution kernel gradient",
}
_BLOCK_SCALED_CALLS = ("__cudnn$blockScaledDot",)
_TENSOR_FUSIONS = {"__triton_gemm": "Triton", "__triton_nested_gemm_fusion": "Triton",
                   "__triton_scaled_dot_fusion": "Triton", "__cudnn$fusion": "cuDNN fusion",
                   "__cublas$fusion": "cuBLAS"}
_PRODUCT_OPS = ("dot", "convolution", "scaled-dot")

# Operations that move or convert values without computing new ones: the walk from a
# product's operand back to where its values were made follows them.
_MOVES = frozenset({"bitcast", "copy", "transpose", "reshape", "slice", "dynamic-slice",
                    "convert", "reverse", "pad", "get-tuple-element", "copy-start",
                    "copy-done", "bitcast-convert", "reduce-precision"})


class _Census:
    """The products and kernels of one parsed module."""

    def __init__(self, module: hlo.Module):
        self.module = module
        self.runs = module.executions

    def narrowest(self, ins: hlo.Instruction) -> str | None:
        """The narrowest float type the value of ``ins`` passed through on its way, moved and
        converted but not computed on (a dequantised float8 tensor: its float8 type)."""
        return self._narrowest(ins, None, 0)

    @functools.lru_cache(maxsize=None)  # pylint: disable=method-cache-max-size-none
    def _narrowest(self, ins: hlo.Instruction | None, index: int | None,
                   depth: int) -> str | None:
        if ins is None or depth > 64:
            return None
        arrays = ins.result if index is None or not ins.is_tuple else ins.result[index:index + 1]
        own = arrays[0].dtype if arrays else None
        if own not in _FLOAT_BITS:
            return None
        found = None
        op = ins.opcode
        if op == "bitcast-convert":
            source_ins = ins.input(0)
            if source_ins is None or source_ins.dtype not in _FLOAT_BITS or (
                    hlo.element_bytes(source_ins.dtype) != hlo.element_bytes(own)):
                return own  # reinterpreted bits (an E8M0 scale, an integer): a new value
        if op == "get-tuple-element":
            found = self._narrowest(ins.input(0), _tuple_index(ins), depth + 1)
        elif op in _MOVES or op == "concatenate":
            for operand in ins.inputs[:1] if op != "concatenate" else ins.inputs:
                found = _narrower(found, self._narrowest(operand, None, depth + 1))
        elif op in ("multiply", "divide"):  # a scaling (a dequantisation): follow the data
            data = [o for o in ins.inputs if self._is_data(o)] or ins.inputs
            for operand in data:
                found = _narrower(found, self._narrowest(operand, None, depth + 1))
        elif op == "clamp":  # a saturating quantisation
            found = self._narrowest(ins.input(1), None, depth + 1)
        elif op == "parameter":
            found = self._narrowest(self.module.argument(ins), None, depth + 1)
        elif op == "fusion":
            for called in ins.called("calls"):
                found = self._narrowest(self.module.root(called), index, depth + 1)
        elif op == "tuple" and index is not None:
            return self._narrowest(ins.input(index), None, depth + 1)
        return _narrower(own, found)

    @functools.lru_cache(maxsize=None)  # pylint: disable=method-cache-max-size-none
    def _is_data(self, ins: hlo.Instruction | None) -> bool:
        """Whether ``ins`` is a tensor's values rather than a broadcast scale or a constant."""
        for _ in range(64):
            if ins is None:
                return False
            if ins.opcode in ("bitcast", "reshape", "convert", "copy"):
                ins = ins.input(0)
            elif ins.opcode == "parameter":
                argument = self.module.argument(ins)
                if argument is None:
                    return True  # an argument of the program, or a loop's state
                ins = argument
            elif ins.opcode == "fusion":
                called = ins.called("calls")
                ins = self.module.root(called[0]) if called else None
            else:
                break
        return ins is not None and ins.opcode not in ("broadcast", "constant", "iota")

    def as_executed(self, ins: hlo.Instruction | None) -> str:
        """An operand's element type, ``"f32<-f8e4m3fn"`` when it was widened on the way."""
        if ins is None:
            return "?"
        own = ins.dtype
        narrowest = self.narrowest(ins)
        if narrowest and own in _FLOAT_BITS and _FLOAT_BITS[narrowest] < _FLOAT_BITS[own]:
            return f"{own}<-{narrowest}"
        return own

    def location(self, ins: hlo.Instruction) -> str:
        return self.module.location(ins, source.in_library)

    # Products.
    def products(self) -> tuple[list[Product], dict[str, list[int]]]:
        """All products, and for each kernel (by name) the indices of those it runs."""
        products: list[Product] = []
        by_kernel: dict[str, list[int]] = collections.defaultdict(list)
        for computation, runs in self.runs.items():
            for ins in self.module.computations.get(computation, ()):
                for product in self._products_of(ins, runs):
                    by_kernel[ins.name].append(len(products))
                    products.append(product)
        return products, by_kernel

    def _products_of(self, ins: hlo.Instruction, runs: int) -> list[Product]:
        if ins.opcode == "custom-call":
            call = ins.custom_call_target
            if call in _GEMM_CALLS:
                config = ins.backend_config.get("gemm_backend_config", {})
                numbers = config.get("dot_dimension_numbers", {})
                contracting = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
                lhs = ins.input(0).dims
                flops = 2 * math.prod(ins.dims) * math.prod(lhs[d] for d in contracting)
                precision = config.get("precision_config", {}).get("operand_precision", [])
                return [self._product(ins, "dot", "cuBLAS", call, ins.inputs[:2], flops, runs,
                                      "highest" if "HIGHEST" in precision else "default")]
            if call in _CONV_CALLS:
                return [self._convolution(ins, _CONV_CALLS[call], "cuDNN", call, runs)]
            if call in _BLOCK_SCALED_CALLS:
                lhs = ins.input(0).dims
                flops = 2 * math.prod(ins.dims) * lhs[-1]
                return [self._product(ins, "block-scaled dot", "cuDNN", call, ins.inputs[:2],
                                      flops, runs)]
            return []
        if ins.opcode == "fusion":
            kind = ins.fusion_kind
            engine = _TENSOR_FUSIONS.get(kind, "loop")
            found = []
            for called in ins.called("calls"):
                for inner in hlo.walk(self.module, called):
                    if inner.opcode in _PRODUCT_OPS:
                        found.append(self._inner_product(inner, engine, kind, runs, ins))
            return found
        if ins.opcode in _PRODUCT_OPS:
            return [self._inner_product(ins, "loop", "unfused", runs, ins)]
        return []

    def _inner_product(self, ins: hlo.Instruction, engine: str, call: str, runs: int,
                       kernel: hlo.Instruction) -> Product:
        if ins.opcode == "convolution":
            return self._convolution(ins, "convolution", engine, call, runs, outer=kernel)
        lhs = ins.input(0).dims
        flops = 2 * math.prod(ins.dims) * math.prod(
            lhs[d] for d in ins.dimensions("lhs_contracting_dims"))
        if ins.opcode == "scaled-dot":
            kind = "block-scaled dot"
        else:
            kind = "dot"
        precision = ins.attribute("operand_precision") or ins.attribute("algorithm") or ""
        highest = "highest" in precision.lower() or "f32_f32_f32" in precision.lower()
        return self._product(ins, kind, engine, call, ins.inputs[:2], flops, runs,
                             "highest" if highest else "default", kernel)

    def _convolution(self, ins, kind, engine, call, runs, outer=None) -> Product:
        labels = re.match(r"(\w+)_(\w+)->(\w+)", ins.attribute("dim_labels") or "")
        operands = [o.dims for o in ins.inputs[:2]]
        if kind == "convolution input gradient":
            forward_out, kernel = operands[0], operands[1]
        elif kind == "convolution kernel gradient":
            forward_out, kernel = operands[1], ins.dims
        else:
            forward_out, kernel = ins.dims, operands[1]
        kernel_labels = labels.group(2) if labels else ""
        features = (kernel[kernel_labels.index("o")]
                    if "o" in kernel_labels and len(kernel_labels) == len(kernel) else 1)
        flops = 2 * math.prod(forward_out) * math.prod(kernel) // max(features, 1)
        return self._product(ins, kind, engine, call, ins.inputs[:2], flops, runs,
                             kernel=outer)

    def _product(self, ins, kind, engine, call, operands, flops, runs, precision="default",
                 kernel=None):
        lhs, rhs = (self.as_executed(o) for o in operands)
        # A product inside a fusion may carry no metadata of its own: its kernel's says.
        named = ins if ins.stack_frame is not None or kernel is None else kernel
        return Product(ins.name, kind, engine, call, lhs, rhs, ins.dtype, int(flops), runs,
                       ins.op_name or named.op_name, self.location(named), precision)

    # Kernels.
    def kernels(self, products: list[Product], by_kernel: dict[str, list[int]]) -> list["Kernel"]:
        kernels = []
        for computation, runs in self.runs.items():
            for ins in self.module.computations.get(computation, ()):
                if ins.opcode in _NOT_KERNELS or ins.opcode.endswith("-done"):
                    continue
                written, read = self._bytes(ins)
                kernels.append(Kernel(
                    ins.name, _kernel_kind(ins), runs, read, written,
                    tuple(by_kernel.get(ins.name, ())), ins.op_name))
        return kernels

    def _bytes(self, ins: hlo.Instruction) -> tuple[float, float]:
        """``(written, read)`` bytes of one launch of the kernel ``ins``."""
        outputs = list(ins.result)
        if ins.opcode == "custom-call" and ins.is_tuple:  # drop the library's workspace
            while len(outputs) > 1 and outputs[-1].dtype in ("s8", "u8"):
                outputs.pop()
        written = [a.nbytes for a in outputs]
        read: dict[str, float] = {}
        for name, operand in zip(ins.operands, ins.inputs):
            read[name] = sum(a.nbytes for a in operand.result) if operand is not None else 0.0
        if ins.opcode == "fusion":
            called = ins.called("calls")
            fused = called[0] if called else ""
            sliced: dict[str, float] = {}
            for parameter in self.module.computations.get(fused, ()):
                number = parameter.parameter_number
                if number is None or number >= len(ins.operands):
                    continue
                taken = self._taken(parameter)
                if taken is not None:
                    name = ins.operands[number]
                    sliced[name] = min(sliced.get(name, 0.0) + taken, read[name])
            read.update(sliced)
            root = self.module.root(fused)
            elements = list(root.inputs) if root is not None and root.opcode == "tuple" else [root]
            for position, element in enumerate(elements):
                in_place = self._in_place(element)
                if in_place is not None and position < len(written):
                    buffer, update = in_place
                    written[position] = update
                    if buffer is not None and buffer < len(ins.operands):
                        read[ins.operands[buffer]] = 0.0
        elif ins.opcode == "dynamic-update-slice" and len(ins.inputs) > 1:
            update = ins.input(1)
            written = [sum(a.nbytes for a in update.result) if update is not None else 0.0]
            read[ins.operands[0]] = 0.0
        return float(sum(written)), float(sum(read.values()))

    def _taken(self, parameter: hlo.Instruction) -> float | None:
        """Bytes a fused parameter's users read of it when every user only slices or gathers
        it (or updates it in place), directly or through elementwise operations of its
        shape (a convert or select before the slice: the kernel computes only the elements
        it slices, as XLA emits a fusion element by element); ``None`` when some user reads
        it whole."""
        array = parameter.result[0] if parameter.result else None
        if array is None:
            return None
        element = array.nbytes / array.size if array.size else 0.0
        seen: set[int] = set()

        def walk(value: hlo.Instruction) -> float | None:
            users = self.module.users.get(value, ())
            if not users and value is not parameter:  # an output of the fusion: computed whole
                return None
            taken = 0.0
            for user in users:
                if id(user) in seen:
                    continue
                seen.add(id(user))
                if user.opcode in ("slice", "dynamic-slice", "gather") and user.input(0) is value:
                    taken += sum(a.size for a in user.result) * element
                elif user.opcode == "dynamic-update-slice" and user.input(0) is value:
                    continue  # in place: not read
                elif user.opcode in _ELEMENTWISE and user.dims == value.dims:
                    more = walk(user)
                    if more is None:
                        return None
                    taken += more
                else:
                    return None
            return taken

        return walk(parameter)

    def _in_place(self, element: hlo.Instruction | None) -> tuple[int | None, float] | None:
        """``(buffer parameter number, update bytes)`` when ``element`` (a fusion output) is
        a dynamic-update-slice of a fused parameter, which XLA runs in place."""
        while element is not None and element.opcode == "bitcast":
            element = element.input(0)
        if element is None or element.opcode != "dynamic-update-slice":
            return None
        buffer, update = element.input(0), element.input(1)
        update_bytes = sum(a.nbytes for a in update.result) if update is not None else 0.0
        return (buffer.parameter_number if buffer is not None else None), update_bytes


def _narrower(a: str | None, b: str | None) -> str | None:
    if a is None or b is None:
        return a or b
    return b if _FLOAT_BITS.get(b, 99) < _FLOAT_BITS.get(a, 99) else a


def _tuple_index(ins: hlo.Instruction) -> int:
    found = re.search(r"index=(\d+)", ins.attributes)
    return int(found.group(1)) if found else 0


# Elementwise HLO operations through which _taken follows a fused parameter to a slice.
_ELEMENTWISE = frozenset({
    "convert", "bitcast-convert", "select", "compare", "add", "subtract", "multiply", "divide",
    "negate", "abs", "maximum", "minimum", "and", "or", "xor", "not", "exponential", "log",
    "sqrt", "rsqrt", "tanh", "clamp", "is-finite", "copy"})


# Instructions that launch nothing: they name, alias or bundle buffers, or run their
# computations (counted on their own) under control flow.
_NOT_KERNELS = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
    "add-dependency", "opt-barrier", "partition-id", "replica-id", "domain", "while",
    "conditional", "call", "async-start", "async-update", "iota"})


def _kernel_kind(ins: hlo.Instruction) -> str:
    if ins.opcode == "fusion":
        return ins.fusion_kind or "fusion"
    if ins.opcode == "custom-call":
        return ins.custom_call_target or "custom-call"
    return ins.opcode


class Kernel(NamedTuple):
    """One kernel launch site of the optimized program.

    Attributes:
        name: the HLO instruction.
        kind: a fusion's kind (``kLoop``, ``kInput``, ``__triton``,
            ``__triton_nested_gemm_fusion``...), a custom call's target, or the opcode.
        runs: launches per step.
        read: bytes its operands hold (per launch; only the slices of a sliced or
            gathered fused parameter).
        written: bytes of its results (per launch; no library workspace; an
            in-place update's update only).
        products: indices into :attr:`GpuProgram.products` of the products it runs.
        op_name: the JAX operation it comes from.

    Examples:
        >>> import jaxmp
        >>> kernel = jaxmp.debug.Kernel("fusion.3", "kLoop", runs=2, read=8192.0,
        ...                             written=4096.0, products=(), op_name="jit(step)/exp")
        >>> kernel.runs * kernel.written  # bytes it writes per step
        8192.0
    """

    name: str
    kind: str
    runs: int
    read: float
    written: float
    products: tuple[int, ...]
    op_name: str


# --- The program -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GpuProgram:
    """The optimized GPU program of a function: its products, kernels, memory and time.

    Made by :func:`jaxmp.debug.gpu_program` (compiling a function) or
    :meth:`GpuProgram.from_hlo` (reading an optimized HLO module's text).

    Attributes:
        target: the :class:`jaxmp.debug.GpuTarget` it was compiled for.
        products: every matrix product and convolution (:class:`Product`).
        kernels: every kernel launch site (:class:`Kernel`).
        temp_bytes: XLA's scratch memory (``memory_analysis().temp_size_in_bytes``),
            ``None`` when read from text.
        requested_flops: :func:`jaxmp.debug.matmul_flops`' count of the program before
            XLA (what jaxmp asked for), ``None`` when read from text.
        unknown_trip_counts: loops counted once because XLA does not know how
            often they run.
        text: the optimized HLO module.
    """

    target: GpuTarget
    products: tuple[Product, ...]
    kernels: tuple[Kernel, ...]
    temp_bytes: int | None = None
    requested_flops: Mapping[str, int] | None = None
    unknown_trip_counts: tuple[str, ...] = ()
    text: str = dataclasses.field(default="", repr=False)

    @classmethod
    def from_hlo(cls, text: str, target: str | GpuTarget = "h100", *,
                 temp_bytes: int | None = None) -> "GpuProgram":
        """The census of an optimized HLO module's text (``compiled.as_text()``, a dump).

        Examples:
            >>> import jaxmp
            >>> text = '''HloModule m
            ... ENTRY %main (a: bf16[64,32], b: bf16[32,16]) -> f32[64,16] {
            ...   %a = bf16[64,32]{1,0} parameter(0)
            ...   %b = bf16[32,16]{1,0} parameter(1)
            ...   %gemm = (f32[64,16]{1,0}, s8[1024]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
            ...   ROOT %out = f32[64,16]{1,0} get-tuple-element(%gemm), index=0
            ... }'''
            >>> program = jaxmp.debug.GpuProgram.from_hlo(text, "h100")
            >>> [(p.engine, p.lhs, p.rhs, p.flops) for p in program.products]
            [('cuBLAS', 'bf16', 'bf16', 65536)]
            >>> program.launches, program.bytes_written  # the workspace is not written to HBM
            (1, 4096.0)
        """
        spec = get_target(target)
        module = hlo.parse(text)
        census = _Census(module)
        products, by_kernel = census.products()
        kernels = census.kernels(products, by_kernel)
        return cls(spec, tuple(products), tuple(kernels), temp_bytes, None,
                   module.unknown_trip_counts, text)

    # Totals.
    @property
    def launches(self) -> int:
        """Kernels launched per step."""
        return sum(k.runs for k in self.kernels)

    @property
    def bytes_written(self) -> float:
        return sum(k.written * k.runs for k in self.kernels)

    @property
    def bytes_read(self) -> float:
        return sum(k.read * k.runs for k in self.kernels)

    @property
    def flops(self) -> int:
        """Product FLOPs per step, as executed."""
        return sum(p.flops * p.runs for p in self.products)

    def matmul_flops(self) -> dict[str, int]:
        """FLOPs by operand dtype *as executed*, keyed as :func:`jaxmp.debug.matmul_flops` does.

        A product whose float8 operands XLA widened counts under the wider dtype;
        a loop-fusion product counts under its operands' dtype.
        """
        totals: dict[str, int] = collections.Counter()
        for p in self.products:
            totals[p.dtype_key] += p.flops * p.runs
        return dict(totals)

    @property
    def float8_native_share(self) -> float:
        """The share of product FLOPs that run on float8 operands on tensor cores."""
        total = self.flops
        native = sum(p.flops * p.runs for p in self.products if p.float8_native)
        return native / total if total else 0.0

    @property
    def requested_float8_share(self) -> float | None:
        """The float8 share of :attr:`requested_flops` (what jaxmp asked XLA for)."""
        if self.requested_flops is None:
            return None
        return lowered_flops.float8_share(dict(self.requested_flops))

    def kernel_seconds(self, kernel: Kernel, *, achieved_rate: float = ACHIEVED_RATE,
                       achieved_bandwidth: float = ACHIEVED_BANDWIDTH,
                       launch: float = LAUNCH_SECONDS) -> float:
        """The estimated time of one launch of ``kernel``: ``max(compute, memory) + launch``."""
        rates = self.target.rates
        compute = sum(self.products[i].flops / (rates.get(self.products[i].unit, rates["f8"])
                                                * achieved_rate) for i in kernel.products)
        memory = (kernel.read + kernel.written) / (self.target.bandwidth * achieved_bandwidth)
        return max(compute, memory) + launch

    @property
    def estimated_seconds(self) -> float:
        """Estimated step time: each launch at the achieved share of the target's peaks
        (:data:`ACHIEVED_RATE`, :data:`ACHIEVED_BANDWIDTH`) plus :data:`LAUNCH_SECONDS`."""
        return sum(self.kernel_seconds(k) * k.runs for k in self.kernels)

    @property
    def roofline_seconds(self) -> float:
        """The same sum at the target's peak rates and bandwidth and no launch cost: a
        lower bound."""
        return sum(self.kernel_seconds(k, achieved_rate=1.0, achieved_bandwidth=1.0, launch=0.0)
                   * k.runs for k in self.kernels)

    def summary(self) -> dict:
        """The census as plain data (JSON-serialisable)."""
        groups: dict[str, list] = {}
        for p in self.products:
            count, flops = groups.get(p.key, (0, 0))
            groups[p.key] = (count + p.runs, flops + p.flops * p.runs)
        kinds = collections.Counter()
        for k in self.kernels:
            kinds[k.kind] += k.runs
        return {
            "target": self.target.name,
            "products": {key: {"count": c, "flops": f} for key, (c, f) in
                         sorted(groups.items(), key=lambda kv: -kv[1][1])},
            "product_count": sum(p.runs for p in self.products),
            "flops": self.flops,
            "float8_native_share": self.float8_native_share,
            "requested_float8_share": self.requested_float8_share,
            "widened_from_float8": sum(p.runs for p in self.products if p.widened_from_float8),
            "loop_products": sum(p.runs for p in self.products if not p.tensor_cores),
            "kernels": self.launches,
            "kernels_by_kind": dict(kinds.most_common()),
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
            "temp_bytes": self.temp_bytes,
            "estimated_ms": 1e3 * self.estimated_seconds,
            "roofline_ms": 1e3 * self.roofline_seconds,
            "unknown_trip_counts": list(self.unknown_trip_counts),
        }

    def __str__(self) -> str:
        s = self.summary()
        total = s["flops"] or 1
        lines = [f"{self.target.description}: {s['product_count']} matrix products and "
                 f"convolutions, {s['flops'] / 1e9:.3g} GFLOP per step"]
        for key, row in s["products"].items():
            lines.append(f"  {row['count']:5d} {100 * row['flops'] / total:5.1f}%  {key}")
        share = f"float8-native share of product FLOPs: {100 * s['float8_native_share']:.1f}%"
        if s["requested_float8_share"]:
            share += f" (jaxmp asked for {100 * s['requested_float8_share']:.1f}%)"
        lines.append("  " + share)
        if s["widened_from_float8"] or s["loop_products"]:
            lines.append(f"  products on operands widened from float8: "
                         f"{s['widened_from_float8']}; products without tensor cores "
                         f"(loop fusions): {s['loop_products']}")
        lines.append(f"kernels launched: {s['kernels']} ("
                     + ", ".join(f"{k} {n}" for k, n in s["kernels_by_kind"].items()) + ")")
        lines.append(f"bytes written {s['bytes_written'] / 2**30:.3f} GiB, read "
                     f"{s['bytes_read'] / 2**30:.3f} GiB per step (sum over kernels)")
        if s["temp_bytes"] is not None:
            lines.append(f"XLA scratch (temp): {s['temp_bytes'] / 2**20:.1f} MiB")
        lines.append(f"estimated step time {s['estimated_ms']:.3f} ms (roofline at peak "
                     f"{s['roofline_ms']:.3f} ms)")
        if s["unknown_trip_counts"]:
            lines.append(f"loops of unknown trip count, counted once: "
                         f"{', '.join(s['unknown_trip_counts'])}")
        return "\n".join(lines)


# --- Compiling -------------------------------------------------------------------------------

_PLUGIN_FIX = (
    "jaxmp compiles for a GPU target through JAX's CUDA plugin, without a GPU: install it "
    "from the jaxmp checkout with `pip install -e \".[gpu-compile]\"` (or directly: `pip "
    "install \"jax[cuda13-local]\" nvidia-cuda-nvcc`, the plugin matching your jax without "
    "NVIDIA libraries, and ptxas) and, on a machine without a GPU, set JAX_PLATFORMS=cpu in the "
    "environment before jax is imported (the plugin then registers without looking for a "
    "driver).")


def plugin_installed() -> bool:
    """Whether a CUDA plugin for jax is installed (it may still be unusable)."""
    import importlib.util  # pylint: disable=import-outside-toplevel
    if importlib.util.find_spec("jax_plugins") is None:
        return False
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") is not None
               for v in (12, 13))


@functools.lru_cache(maxsize=None)
def _mesh(config: str, name: str):
    import jax  # pylint: disable=import-outside-toplevel
    from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=config,
                                                topology="1x1x1")
    except Exception as error:  # pylint: disable=broad-except  (jax raises several kinds)
        why = ("no CUDA plugin for jax is installed" if not plugin_installed() else
               f"the CUDA plugin did not register ({type(error).__name__}: {error})")
        raise RuntimeError(f"jaxmp: cannot compile for {name}: {why}.\n  Fix: {_PLUGIN_FIX}") \
            from error
    return jax.sharding.Mesh(topology.devices, ("x",))


# Programs compiled, by the lowered program's fingerprint and target (compiling a step
# takes seconds to minutes; the FLOP tools and the census often ask for the same one).
_COMPILED: collections.OrderedDict = collections.OrderedDict()
_COMPILED_SIZE = 8


def gpu_program(fn: Callable, *args: Any, target: str | GpuTarget = "h100",
                **kwargs: Any) -> GpuProgram:
    """Compiles ``fn`` for a GPU target without a GPU and reads what the GPU would run.

    ``fn`` is compiled as ``jax.jit(fn)`` (or as it is, if it is already a
    ``jax.jit`` function, so that its ``donate_argnums`` and static arguments
    hold) for the target through JAX's CUDA plugin (deviceless
    ahead-of-time compilation, XLA's default settings, no autotuning) and the
    optimized program is read: see :class:`GpuProgram`. ``str()`` of the result
    is a readable census. Flax NNX modules and an ``nnx.Optimizer`` among the
    arguments are compiled as their state, with their in-place updates as
    outputs (as ``nnx.jit`` does).

    Args:
        fn: the function, e.g. a whole training step.
        *args: its arguments: arrays, ``jax.ShapeDtypeStruct`` or any pytree of
            them (non-array leaves are closed over); nothing is computed.
        target: ``"h100"`` (sm_90) or ``"b200"`` (sm_100), or a
            :class:`jaxmp.debug.GpuTarget` (its ``config`` is what XLA compiles for; its
            rates and bandwidth are what the estimate uses).
        **kwargs: keyword arguments of ``fn``.

    Returns:
        A :class:`jaxmp.debug.GpuProgram`.

    Raises:
        RuntimeError: JAX's CUDA plugin is absent or did not register; the
            message says how to install it.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxmp
        >>> def f(w, x):
        ...     return jnp.tanh(x @ w)
        >>> w = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)
        >>> x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
        >>> program = jaxmp.debug.gpu_program(f, w, x, target="h100")  # doctest: +SKIP
        >>> [(p.engine, p.lhs, p.rhs) for p in program.products]  # doctest: +SKIP
        [('Triton', 'bf16', 'bf16')]
    """
    import jax  # pylint: disable=import-outside-toplevel
    from jaxmp._src import jaxprs  # pylint: disable=import-outside-toplevel
    from jaxmp._src import host  # pylint: disable=import-outside-toplevel
    from jaxmp._src import in_place  # pylint: disable=import-outside-toplevel

    spec = get_target(target)
    mesh = _mesh(spec.config, spec.name)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def placed(x):
        return jaxprs.shape_dtype(x, sharding=replicated)

    # NNX modules and optimizers among the arguments: their in-place updates are outputs.
    pure, args, kwargs = in_place.functional(fn, args, kwargs)
    with host.no_host_callbacks():  # host callbacks cannot be compiled for another platform
        if pure is fn and hasattr(fn, "trace") and hasattr(fn, "lower"):
            # Already jitted: keep its options.
            dynamic = jax.tree_util.tree_map(
                lambda x: placed(x) if jaxprs.is_dynamic(x) else x, (args, kwargs))
            traced = fn.trace(*dynamic[0], **dynamic[1])
        else:
            call, dynamic = jaxprs.array_function(pure, args, kwargs)
            traced = jax.jit(call).trace(jax.tree_util.tree_map(placed, dynamic))
        lowered = traced.lower()
    stablehlo = lowered.as_text()
    requested = lowered_flops.module_flops(stablehlo)
    in_place.refuse_if_uncounted(traced.jaxpr, sum(requested.values()), "jaxmp.debug.gpu_program")
    key = (hashlib.sha256(stablehlo.encode()).hexdigest(), spec.config)
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        program = dataclasses.replace(_COMPILED[key], target=spec)  # the estimate's rates
    else:
        compiled = lowered.compile()
        memory = compiled.memory_analysis()
        program = GpuProgram.from_hlo(compiled.as_text(), spec,
                                      temp_bytes=getattr(memory, "temp_size_in_bytes", None))
        program = dataclasses.replace(program, requested_flops=requested)
        _COMPILED[key] = program
        while len(_COMPILED) > _COMPILED_SIZE:
            _COMPILED.popitem(last=False)
    warn_if_float8_shortfall(program)  # once per place (messages.warn_once)
    return program


# Why the GPU runs a product wider than float8, and the fix: one row per case.
_SHORTFALL = {
    "block_scaled": (
        "XLA expands jax.nn.scaled_matmul (float8_scaling=\"mxfp8\") into float32 products "
        "on a GPU without block-scaled GEMMs (cuDNN's block-scaled dot needs sm_100, Blackwell, "
        "and cuDNN >= 9.7)",
        "on this GPU use float8_scaling=\"tensor\""),
    "convolution": (
        "XLA runs a float8 convolution in float8 only where cuDNN has a float8 graph for it "
        "(forward convolutions); it widens the operands of the others",
        "keep convolutions in the compute dtype with jaxmp.experimental.Float8Rules(primitives="
        "{\"dot_general\"})"),
    "other": (
        "XLA widened its operands before the product",
        "print(jaxmp.debug.gpu_program(step, *args, target=...)) lists how every product is "
        "compiled"),
}


def _wider_first(program: GpuProgram) -> Product | None:
    """The product to name first among those not on float8 tensor cores: widened from
    float8 first, then without tensor cores, then on float32, then the most FLOPs."""
    wider = [p for p in program.products if not p.float8_native]
    if not wider:
        return None
    return min(wider, key=lambda p: (not p.widened_from_float8, p.tensor_cores,
                                     p.unit not in ("f32", "tf32"), -p.flops * p.runs))


def warn_if_float8_shortfall(program: GpuProgram, tolerance: float = 0.005) -> bool:
    """Warns (:class:`jaxmp.experimental.Float8ShortfallWarning`) when the GPU runs a smaller share of the
    product FLOPs in float8 than the program before XLA asks for; returns whether it warned."""
    from jaxmp._src import shortfall  # pylint: disable=import-outside-toplevel
    requested = program.requested_float8_share
    native = program.float8_native_share
    if not requested or native >= requested - tolerance:
        return False
    first = _wider_first(program)
    if first is None:
        return False
    if "scaled_matmul" in first.op_name or first.kind == "block-scaled dot":
        why, fix = _SHORTFALL["block_scaled"]
    elif first.kind.startswith("convolution"):
        why, fix = _SHORTFALL["convolution"]
    else:
        why, fix = _SHORTFALL["other"]
    where = first.location or first.op_name or first.name
    return messages.warn_once(
        ("gpu_program", program.target.name, where, first.kind, first.engine),
        f"jaxmp: on {program.target.description} XLA runs {messages.percent(native)} of the "
        f"matrix-product FLOPs of this program on float8 tensor cores, where jaxmp asks for "
        f"{messages.percent(requested)} (the program before XLA; jaxmp.debug.matmul_flops without "
        f"target). The first product that runs wider is a {first.kind} compiled as "
        f"{first.how} on {first.lhs} x {first.rhs} operands at {where}: "
        f"{why}.\n  Fix: {fix}.",
        shortfall.Float8ShortfallWarning)
