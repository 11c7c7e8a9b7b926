"""A plain-JAX Vision Transformer, the model of the paper's evaluation.

Written as an ordinary float32 model: no casts anywhere. Every operation
follows the dtype of its inputs, so calling it with float16 or bfloat16
parameters and images runs it entirely in half precision, and it runs under
``jax_numpy_dtype_promotion="strict"`` (constants are Python scalars, which
take the dtype of the array they meet).

Parameters are a plain pytree (dicts and a list of per-block dicts), so any
mixed-precision library can cast them with ``jax.tree_util``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """Shapes of a Vision Transformer.

    Attributes:
        image_size: height and width of the (square) input images.
        patch_size: height and width of a patch; divides ``image_size``.
        channels: colour channels of the images.
        width: size of the token embeddings.
        depth: number of transformer blocks.
        heads: attention heads per block; divides ``width``.
        mlp_dim: hidden size of the MLP of each block.
        num_classes: number of output classes.
    """

    image_size: int
    patch_size: int
    channels: int
    width: int
    depth: int
    heads: int
    mlp_dim: int
    num_classes: int

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


# The paper's desktop model, on CIFAR-100 shapes (32x32x3 images, 100 classes).
DESKTOP_VIT = ViTConfig(
    image_size=32, patch_size=4, channels=3, width=256, depth=6, heads=8, mlp_dim=800, num_classes=100
)
# ViT-Base/16 on ImageNet shapes.
VIT_BASE = ViTConfig(
    image_size=224, patch_size=16, channels=3, width=768, depth=12, heads=12, mlp_dim=3072, num_classes=1000
)
# Small enough for unit tests and the quick benchmark.
TINY_VIT = ViTConfig(
    image_size=8, patch_size=4, channels=3, width=32, depth=2, heads=2, mlp_dim=64, num_classes=10
)


def _dense_init(key: jax.Array, fan_in: int, fan_out: int) -> Params:
    w = jax.random.normal(key, (fan_in, fan_out), jnp.float32) / math.sqrt(fan_in)
    return {"w": w, "b": jnp.zeros((fan_out,), jnp.float32)}


def _norm_init(dim: int) -> Params:
    return {"scale": jnp.ones((dim,), jnp.float32), "bias": jnp.zeros((dim,), jnp.float32)}


def init_vit(key: jax.Array, config: ViTConfig) -> Params:
    """Initialises float32 parameters for ``config``.

    Examples:
        >>> import jax
        >>> params = init_vit(jax.random.key(0), TINY_VIT)
        >>> params["embed"]["w"].shape, len(params["blocks"])
        ((48, 32), 2)
    """
    if config.image_size % config.patch_size or config.width % config.heads:
        raise ValueError(f"patch_size must divide image_size and heads must divide width: {config}")
    keys = jax.random.split(key, config.depth + 4)
    patch_dim = config.patch_size * config.patch_size * config.channels
    blocks = []
    for k in keys[4:]:
        k1, k2, k3, k4 = jax.random.split(k, 4)
        blocks.append(
            {
                "norm1": _norm_init(config.width),
                "qkv": _dense_init(k1, config.width, 3 * config.width),
                "out": _dense_init(k2, config.width, config.width),
                "norm2": _norm_init(config.width),
                "mlp1": _dense_init(k3, config.width, config.mlp_dim),
                "mlp2": _dense_init(k4, config.mlp_dim, config.width),
            }
        )
    return {
        "embed": _dense_init(keys[0], patch_dim, config.width),
        "cls": 0.02 * jax.random.normal(keys[1], (1, 1, config.width), jnp.float32),
        "pos": 0.02 * jax.random.normal(keys[2], (1, config.num_patches + 1, config.width), jnp.float32),
        "blocks": blocks,
        "norm": _norm_init(config.width),
        "head": _dense_init(keys[3], config.width, config.num_classes),
    }


def _dense(p: Params, x: jax.Array) -> jax.Array:
    return x @ p["w"] + p["b"]


def _layer_norm(p: Params, x: jax.Array) -> jax.Array:
    return jax.nn.standardize(x, axis=-1, epsilon=1e-6) * p["scale"] + p["bias"]


def _attention(p: Params, x: jax.Array, heads: int) -> jax.Array:
    batch, tokens, width = x.shape
    head_dim = width // heads
    qkv = _dense(p["qkv"], x).reshape(batch, tokens, 3, heads, head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
    weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, tokens, width)
    return _dense(p["out"], out)


def _patchify(images: jax.Array, patch: int) -> jax.Array:
    batch, height, width, channels = images.shape
    x = images.reshape(batch, height // patch, patch, width // patch, patch, channels)
    x = x.transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(batch, (height // patch) * (width // patch), patch * patch * channels)


def vit_apply(params: Params, images: jax.Array, config: ViTConfig) -> jax.Array:
    """Logits ``[B, num_classes]`` for images ``[B, H, W, C]``, in the dtype of the inputs.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> params = init_vit(jax.random.key(0), TINY_VIT)
        >>> vit_apply(params, jnp.zeros((2, 8, 8, 3)), TINY_VIT).shape
        (2, 10)
    """
    x = _dense(params["embed"], _patchify(images, config.patch_size))
    cls = jnp.broadcast_to(params["cls"], (x.shape[0], 1, config.width))
    x = jnp.concatenate([cls, x], axis=1) + params["pos"]
    for block in params["blocks"]:
        x = x + _attention(block, _layer_norm(block["norm1"], x), config.heads)
        h = jax.nn.gelu(_dense(block["mlp1"], _layer_norm(block["norm2"], x)))
        x = x + _dense(block["mlp2"], h)
    x = _layer_norm(params["norm"], x[:, 0])
    return _dense(params["head"], x)


def vit_loss(params: Params, images: jax.Array, labels: jax.Array, config: ViTConfig) -> jax.Array:
    """Mean softmax cross-entropy of the ViT on a batch; ``labels`` are int32 ``[B]``.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> params = init_vit(jax.random.key(0), TINY_VIT)
        >>> loss = vit_loss(params, jnp.zeros((2, 8, 8, 3)), jnp.zeros((2,), jnp.int32), TINY_VIT)
        >>> loss.shape, loss.dtype
        ((), dtype('float32'))
    """
    log_probs = jax.nn.log_softmax(vit_apply(params, images, config), axis=-1)
    picked = jnp.take_along_axis(log_probs, labels[:, None].astype(jnp.int32), axis=-1)
    return -jnp.mean(picked)


# --- The same ViT as a user would write it in plain float32 ------------------------------
#
# Same parameters and shapes as ``vit_apply``, but written without any thought
# for mixed precision: layer norm and softmax by hand (no max subtraction, no
# fused statistics) and the attention scale as a NumPy ``float64`` scalar, the
# type-promotion trap of the paper: ``q @ k / np.sqrt(d)`` turns float16
# logits back into float32 (float64 where x64 is enabled), so casting the
# inputs of this model to half precision leaves the attention in float32.
# It runs under standard promotion (the NumPy scalar is not allowed under
# strict promotion, which is the point).


def _plain_layer_norm(p: Params, x: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-6) * p["scale"] + p["bias"]


def _plain_softmax(x: jax.Array) -> jax.Array:
    e = jnp.exp(x)
    return e / jnp.sum(e, axis=-1, keepdims=True)


def _plain_attention(p: Params, x: jax.Array, heads: int) -> jax.Array:
    batch, tokens, width = x.shape
    head_dim = width // heads
    qkv = _dense(p["qkv"], x).reshape(batch, tokens, 3, heads, head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)  # a NumPy float64 scalar
    out = jnp.einsum("bhqk,bkhd->bqhd", _plain_softmax(logits), v)
    return _dense(p["out"], out.reshape(batch, tokens, width))


def plain_vit_apply(params: Params, images: jax.Array, config: ViTConfig) -> jax.Array:
    """The ViT of :func:`vit_apply` written naively in float32 (see above); float32 logits.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> params = init_vit(jax.random.key(0), TINY_VIT)
        >>> plain_vit_apply(params, jnp.zeros((2, 8, 8, 3)), TINY_VIT).shape
        (2, 10)
    """
    with jax.numpy_dtype_promotion("standard"):
        x = _dense(params["embed"], _patchify(images, config.patch_size))
        cls = jnp.broadcast_to(params["cls"], (x.shape[0], 1, config.width))
        x = jnp.concatenate([cls.astype(x.dtype), x], axis=1) + params["pos"]
        for block in params["blocks"]:
            x = x + _plain_attention(block, _plain_layer_norm(block["norm1"], x), config.heads)
            h = jax.nn.gelu(_dense(block["mlp1"], _plain_layer_norm(block["norm2"], x)))
            x = x + _dense(block["mlp2"], h)
        x = _plain_layer_norm(params["norm"], x[:, 0])
        logits = _dense(params["head"], x)
        return logits


def plain_vit_loss(params: Params, images: jax.Array, labels: jax.Array, config: ViTConfig) -> jax.Array:
    """Cross-entropy of :func:`plain_vit_apply`, with a hand-written log-softmax.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> params = init_vit(jax.random.key(0), TINY_VIT)
        >>> loss = plain_vit_loss(params, jnp.zeros((2, 8, 8, 3)), jnp.zeros((2,), jnp.int32), TINY_VIT)
        >>> loss.shape, loss.dtype
        ((), dtype('float32'))
    """
    with jax.numpy_dtype_promotion("standard"):
        logits = plain_vit_apply(params, images, config)
        log_z = jnp.log(jnp.sum(jnp.exp(logits), axis=-1, keepdims=True))
        picked = jnp.take_along_axis(logits - log_z, labels[:, None].astype(jnp.int32), axis=-1)
        return -jnp.mean(picked)


#: The two benchmark models: loss functions ``(params, images, labels, config)``.
LOSSES = {"vit": vit_loss, "plain_vit": plain_vit_loss}


# --- A GPT-style language model and a small ResNet, as experts write them -----------------
#
# Written for float32 parameters, with the precautions of a hand-written mixed-precision
# model built in: layer-norm and batch-norm statistics, the softmax of the attention and
# the loss are computed in float32 whatever the dtype of the activations, and the result
# goes back to that dtype. Called with bfloat16 parameters (and inputs), they are the
# hand-written bfloat16 step of ``benchmarks/gpu_program.py``; called under jaxmp, they
# are what jaxmp's autocast is given. Parameters are plain pytrees.


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shapes of a GPT-style decoder (learned positions, pre-norm blocks, causal attention,
    a GELU MLP of ``4 * width``, an output projection of its own) and of its batch."""

    vocab: int
    seq: int
    width: int
    depth: int
    heads: int
    batch: int


# The GPT of issue 31's table (2 blocks) and one small enough for tests and --quick runs.
GPT_2L = GPTConfig(vocab=32768, seq=1024, width=1024, depth=2, heads=16, batch=8)
GPT_TINY = GPTConfig(vocab=512, seq=64, width=64, depth=1, heads=2, batch=2)


def init_gpt(key: jax.Array, config: GPTConfig) -> Params:
    """Float32 parameters of the GPT of ``config``.

    Examples:
        >>> import jax
        >>> params = init_gpt(jax.random.key(0), GPT_TINY)
        >>> params["embed"].shape, len(params["blocks"])
        ((512, 64), 1)
    """
    if config.width % config.heads:
        raise ValueError(f"heads must divide width: {config}")
    keys = jax.random.split(key, config.depth + 3)
    width = config.width
    blocks = []
    for k in keys[3:]:
        k1, k2, k3, k4 = jax.random.split(k, 4)
        blocks.append({"norm1": _norm_init(width), "qkv": _dense_init(k1, width, 3 * width),
                       "out": _dense_init(k2, width, width), "norm2": _norm_init(width),
                       "mlp1": _dense_init(k3, width, 4 * width),
                       "mlp2": _dense_init(k4, 4 * width, width)})
    return {"embed": 0.02 * jax.random.normal(keys[0], (config.vocab, width), jnp.float32),
            "pos": 0.02 * jax.random.normal(keys[1], (config.seq, width), jnp.float32),
            "blocks": blocks, "norm": _norm_init(width),
            "head": _dense_init(keys[2], width, config.vocab)}


def _float32_layer_norm(p: Params, x: jax.Array) -> jax.Array:
    """Layer norm with float32 statistics; the result in ``x``'s dtype."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = ((xf - mean) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype)
    return y * p["scale"] + p["bias"]


def _causal_attention(p: Params, x: jax.Array, heads: int) -> jax.Array:
    batch, tokens, width = x.shape
    head_dim = width // heads
    qkv = _dense(p["qkv"], x).reshape(batch, tokens, 3, heads, head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / math.sqrt(head_dim))
    causal = jnp.tril(jnp.ones((tokens, tokens), bool))
    logits = jnp.where(causal, logits.astype(jnp.float32), -1e9)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)  # the softmax in float32
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, tokens, width)
    return _dense(p["out"], out)


def gpt_loss(params: Params, tokens: jax.Array, labels: jax.Array, config: GPTConfig) -> jax.Array:
    """Mean next-token cross-entropy (in float32) of the GPT on int32 ``[B, T]`` tokens.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> params = init_gpt(jax.random.key(0), GPT_TINY)
        >>> tokens = jnp.zeros((2, 64), jnp.int32)
        >>> loss = gpt_loss(params, tokens, tokens, GPT_TINY)
        >>> loss.shape, loss.dtype
        ((), dtype('float32'))
    """
    x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
    for block in params["blocks"]:
        x = x + _causal_attention(block, _float32_layer_norm(block["norm1"], x), config.heads)
        h = jax.nn.gelu(_dense(block["mlp1"], _float32_layer_norm(block["norm2"], x)))
        x = x + _dense(block["mlp2"], h)
    logits = _dense(params["head"], _float32_layer_norm(params["norm"], x))
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # the loss in float32
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[..., None], axis=-1))


# --- The GPT-style decoder of the scaling benchmark, written for any dtype -------------------
#
# The parameters of ``init_gpt``; the blocks written like ``vit_apply``'s (no casts:
# ``jax.nn.standardize``, ``jax.nn.softmax``, Python-scalar constants), so that the model
# called with float16 parameters is the hand-written float16 step. The causal mask is
# ``jnp.where(causal, logits, -1e9)``: ``-inf`` in float16, by design.

# Issue 33's decoder (its depth is what the benchmark varies).
DECODER = GPTConfig(vocab=1024, seq=128, width=256, depth=16, heads=4, batch=8)


def _masked_attention(p: Params, x: jax.Array, heads: int) -> jax.Array:
    batch, tokens, width = x.shape
    head_dim = width // heads
    qkv = _dense(p["qkv"], x).reshape(batch, tokens, 3, heads, head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((tokens, tokens), bool))
    weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, tokens, width)
    return _dense(p["out"], out)


def decoder_block(block: Params, x: jax.Array, heads: int) -> jax.Array:
    """One pre-norm block of :func:`decoder_loss`: causal attention, then a GELU MLP."""
    x = x + _masked_attention(block, _layer_norm(block["norm1"], x), heads)
    h = jax.nn.gelu(_dense(block["mlp1"], _layer_norm(block["norm2"], x)))
    return x + _dense(block["mlp2"], h)


def stack_blocks(params: Params) -> Params:
    """``params`` with its list of blocks stacked into one block of arrays with a leading
    layer axis: the parameters of ``decoder_loss(..., scan=True)``."""
    blocks = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *params["blocks"])
    return {**params, "blocks": blocks}


def decoder_loss(params: Params, tokens: jax.Array, labels: jax.Array, config: GPTConfig,
                 scan: bool = False) -> jax.Array:
    """Mean next-token cross-entropy of the decoder on int32 ``[B, T]`` tokens.

    With ``scan=True`` the blocks run under ``jax.lax.scan`` over the parameters of
    :func:`stack_blocks`; otherwise one after another (unrolled).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> params = init_gpt(jax.random.key(0), GPT_TINY)
        >>> tokens = jnp.zeros((2, 64), jnp.int32)
        >>> unrolled = decoder_loss(params, tokens, tokens, GPT_TINY)
        >>> scanned = decoder_loss(stack_blocks(params), tokens, tokens, GPT_TINY, scan=True)
        >>> unrolled.dtype, bool(jnp.allclose(unrolled, scanned, rtol=1e-5))
        (dtype('float32'), True)
    """
    x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
    if scan:
        x, _ = jax.lax.scan(lambda x, block: (decoder_block(block, x, config.heads), None),
                            x, params["blocks"])
    else:
        for block in params["blocks"]:
            x = decoder_block(block, x, config.heads)
    logits = _dense(params["head"], _layer_norm(params["norm"], x))
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[..., None], axis=-1))


def gpt_batch(config: GPTConfig) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """The shapes of a batch: tokens and next-token labels."""
    shape = jax.ShapeDtypeStruct((config.batch, config.seq), jnp.int32)
    return shape, shape


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """Shapes of a small ResNet (a 3x3 stem, stages of two basic blocks whose first
    halves the resolution after the first stage, batch norm on batch statistics, global
    average pooling, a dense head), NHWC, and of its batch."""

    image_size: int
    channels: int
    stages: tuple[int, ...]
    num_classes: int
    batch: int


# The ResNet of issue 31's table and one small enough for tests and --quick runs.
RESNET_SMALL = ResNetConfig(image_size=32, channels=3, stages=(64, 128, 256), num_classes=100,
                            batch=128)
RESNET_TINY = ResNetConfig(image_size=8, channels=3, stages=(16, 32), num_classes=10, batch=4)


def _conv_init(key: jax.Array, size: int, cin: int, cout: int) -> jax.Array:
    return jax.random.normal(key, (size, size, cin, cout), jnp.float32) * math.sqrt(
        2.0 / (size * size * cin))


def init_resnet(key: jax.Array, config: ResNetConfig) -> Params:
    """Float32 parameters of the ResNet of ``config``.

    Examples:
        >>> import jax
        >>> params = init_resnet(jax.random.key(0), RESNET_TINY)
        >>> params["stem"]["w"].shape, [len(s) for s in params["stages"]]
        ((3, 3, 3, 16), [2, 2])
    """
    keys = iter(jax.random.split(key, 2 + 6 * len(config.stages)))
    cin = config.stages[0]
    params = {"stem": {"w": _conv_init(next(keys), 3, config.channels, cin),
                       "norm": _norm_init(cin)}, "stages": []}
    for index, cout in enumerate(config.stages):
        stage = []
        for block in range(2):
            stride = 2 if index > 0 and block == 0 else 1
            p = {"conv1": _conv_init(next(keys), 3, cin, cout), "norm1": _norm_init(cout),
                 "conv2": _conv_init(next(keys), 3, cout, cout), "norm2": _norm_init(cout)}
            if stride != 1 or cin != cout:
                p["proj"] = _conv_init(next(keys), 1, cin, cout)
                p["norm_proj"] = _norm_init(cout)
            stage.append(p)
            cin = cout
        params["stages"].append(stage)
    params["head"] = _dense_init(next(keys), cin, config.num_classes)
    return params


def _conv(x: jax.Array, w: jax.Array, stride: int = 1) -> jax.Array:
    return jax.lax.conv_general_dilated(x, w, (stride, stride), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _float32_batch_norm(p: Params, x: jax.Array) -> jax.Array:
    """Batch norm on the batch's statistics, computed in float32; the result in ``x``'s dtype."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=(0, 1, 2))
    var = jnp.mean(jnp.square(xf - mean), axis=(0, 1, 2))
    y = ((xf - mean) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype)
    return y * p["scale"] + p["bias"]


def resnet_loss(params: Params, images: jax.Array, labels: jax.Array,
                config: ResNetConfig) -> jax.Array:
    """Mean cross-entropy (in float32) of the ResNet on ``[B, H, W, C]`` images.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> params = init_resnet(jax.random.key(0), RESNET_TINY)
        >>> loss = resnet_loss(params, jnp.zeros((4, 8, 8, 3)), jnp.zeros((4,), jnp.int32),
        ...                    RESNET_TINY)
        >>> loss.shape, loss.dtype
        ((), dtype('float32'))
    """
    x = jax.nn.relu(_float32_batch_norm(params["stem"]["norm"], _conv(images, params["stem"]["w"])))
    for index, stage in enumerate(params["stages"]):
        for block, p in enumerate(stage):
            stride = 2 if index > 0 and block == 0 else 1
            y = jax.nn.relu(_float32_batch_norm(p["norm1"], _conv(x, p["conv1"], stride)))
            y = _float32_batch_norm(p["norm2"], _conv(y, p["conv2"]))
            if "proj" in p:
                x = _float32_batch_norm(p["norm_proj"], _conv(x, p["proj"], stride))
            x = jax.nn.relu(x + y)
    pooled = jnp.mean(x.astype(jnp.float32), axis=(1, 2)).astype(x.dtype)
    log_probs = jax.nn.log_softmax(_dense(params["head"], pooled).astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=-1))


def resnet_batch(config: ResNetConfig) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """The shapes of a batch: float32 NHWC images and int32 labels."""
    return (jax.ShapeDtypeStruct((config.batch, config.image_size, config.image_size,
                                  config.channels), jnp.float32),
            jax.ShapeDtypeStruct((config.batch,), jnp.int32))
