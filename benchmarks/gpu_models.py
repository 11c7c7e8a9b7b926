"""The models users train, for ``benchmarks/gpu_program.py`` (issue 41).

* ``llama``: a LLaMA-7B-shaped decoder in plain JAX (width 4096, 32 heads, a SwiGLU FFN
  of 11008, RMSNorm, rotary position embeddings, 2 layers, vocabulary 32000, sequence
  2048, batch 2);
* ``gpt_small``: the GPT of ``benchmarks/models.py`` at GPT-small's shapes (width 768,
  12 heads, FFN 3072, 4 layers, sequence 1024, batch 8, vocabulary 32000);
* ``resnet50``: ResNet-50 written in Flax linen the way google/flax's
  ``examples/imagenet/models.py`` writes it (bottleneck blocks [3, 4, 6, 3], batch norm on
  the batch's statistics, 224x224 images, batch 64, 1000 classes);
* ``scan_decoder``: a MaxText-style linen decoder: LLaMA layers under ``nn.remat`` inside
  ``nn.scan`` (``scan_decoder_small``: 4 layers of width 128).

Each comes with its hand-written bfloat16 twin, written the way experts write it: the
transformers take their float32 parameters cast to bfloat16 inside the loss (their
normalisation statistics, softmax and loss stay float32, as in ``models.py``); the ResNet
is the same module with Flax's own ``dtype=jnp.bfloat16``. Every model has a tiny
configuration that compiles in seconds (``quick=True``).

The ResNet's loss runs batch norm in training mode and drops the running averages it
updates (a step that keeps them writes two vectors per batch norm more).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from benchmarks import models

Params = dict[str, Any]


class Spec(NamedTuple):
    """What ``gpu_program.py`` needs of a model.

    Attributes:
        loss: ``loss(params, *batch)``, the float32 model (what jaxmp is given).
        init: ``init(key) -> params`` (float32).
        batch: the shapes of a batch (``jax.ShapeDtypeStruct``).
        config: the model's shapes.
        hand_loss: the hand-written bfloat16 twin, ``None`` when it is ``loss`` on the
            parameters (and floating inputs) cast to bfloat16 inside the loss.
    """

    loss: Callable
    init: Callable
    batch: tuple
    config: Any
    hand_loss: Callable | None = None


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # in float32
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[..., None], axis=-1))


# --- The LLaMA-shaped decoder, plain JAX --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shapes of a LLaMA-style decoder (RMSNorm, rotary embeddings, SwiGLU, untied head)."""

    vocab: int
    seq: int
    width: int
    depth: int
    heads: int
    ffn: int
    batch: int


LLAMA_7B_BLOCK = LlamaConfig(vocab=32000, seq=2048, width=4096, depth=2, heads=32, ffn=11008,
                             batch=2)
LLAMA_TINY = LlamaConfig(vocab=256, seq=32, width=64, depth=1, heads=4, ffn=176, batch=2)


def _matrix(key: jax.Array, fan_in: int, fan_out: int) -> jax.Array:
    return jax.random.normal(key, (fan_in, fan_out), jnp.float32) / math.sqrt(fan_in)


def init_llama(key: jax.Array, config: LlamaConfig) -> Params:
    """Float32 parameters of the LLaMA-style decoder of ``config``."""
    if config.width % config.heads or (config.width // config.heads) % 2:
        raise ValueError(f"heads must divide width into even head sizes: {config}")
    keys = jax.random.split(key, config.depth + 2)
    w, f = config.width, config.ffn
    layers = []
    for k in keys[2:]:
        kq, kk, kv, ko, k1, k2, k3 = jax.random.split(k, 7)
        layers.append({"attn_norm": jnp.ones((w,), jnp.float32),
                       "q": _matrix(kq, w, w), "k": _matrix(kk, w, w), "v": _matrix(kv, w, w),
                       "o": _matrix(ko, w, w), "ffn_norm": jnp.ones((w,), jnp.float32),
                       "gate": _matrix(k1, w, f), "up": _matrix(k2, w, f),
                       "down": _matrix(k3, f, w)})
    return {"embed": 0.02 * jax.random.normal(keys[0], (config.vocab, w), jnp.float32),
            "layers": layers, "norm": jnp.ones((w,), jnp.float32),
            "head": _matrix(keys[1], w, config.vocab)}


def rms_norm(scale: jax.Array, x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """RMSNorm with float32 statistics; the result in ``x``'s dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype) * scale


def rope(x: jax.Array) -> jax.Array:
    """Rotary position embeddings of ``[B, T, H, D]`` (angles in float32)."""
    tokens, dim = x.shape[1], x.shape[-1]
    inverse = 1.0 / (10000.0 ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angles = jnp.arange(tokens, dtype=jnp.float32)[:, None] * inverse[None, :]
    cos = jnp.cos(angles)[None, :, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[None, :, None, :].astype(x.dtype)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention of ``[B, T, H, D]`` heads, the softmax in float32."""
    tokens, head_dim = q.shape[1], q.shape[-1]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1.0 / math.sqrt(head_dim))
    causal = jnp.tril(jnp.ones((tokens, tokens), bool))
    logits = jnp.where(causal, logits.astype(jnp.float32), -1e9)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def _llama_layer(p: Params, x: jax.Array, heads: int) -> jax.Array:
    batch, tokens, width = x.shape
    h = rms_norm(p["attn_norm"], x)
    split = lambda y: y.reshape(batch, tokens, heads, width // heads)  # noqa: E731
    q, k, v = split(h @ p["q"]), split(h @ p["k"]), split(h @ p["v"])
    out = causal_attention(rope(q), rope(k), v).reshape(batch, tokens, width)
    x = x + out @ p["o"]
    h = rms_norm(p["ffn_norm"], x)
    return x + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]


def llama_loss(params: Params, tokens: jax.Array, labels: jax.Array,
               config: LlamaConfig) -> jax.Array:
    """Mean next-token cross-entropy (in float32) on int32 ``[B, T]`` tokens.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> params = init_llama(jax.random.key(0), LLAMA_TINY)
        >>> tokens = jnp.zeros((2, 32), jnp.int32)
        >>> llama_loss(params, tokens, tokens, LLAMA_TINY).dtype
        dtype('float32')
    """
    x = params["embed"][tokens]
    for layer in params["layers"]:
        x = _llama_layer(layer, x, config.heads)
    return _cross_entropy(rms_norm(params["norm"], x) @ params["head"], labels)


def _tokens(config) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    shape = jax.ShapeDtypeStruct((config.batch, config.seq), jnp.int32)
    return shape, shape


# --- ResNet-50, Flax linen, as google/flax's ImageNet example writes it ------------------


@dataclasses.dataclass(frozen=True)
class ResNet50Config:
    """Shapes of a bottleneck ResNet and of its batch (NHWC images)."""

    stages: tuple[int, ...]
    filters: int
    image_size: int
    num_classes: int
    batch: int


RESNET50 = ResNet50Config(stages=(3, 4, 6, 3), filters=64, image_size=224, num_classes=1000,
                          batch=64)
RESNET50_TINY = ResNet50Config(stages=(1, 1), filters=8, image_size=32, num_classes=10, batch=2)


class Bottleneck(nn.Module):
    """A bottleneck block: 1x1, 3x3 (strided), 1x1 at four times the width, each followed
    by batch norm, a projected shortcut where the shape changes."""

    filters: int
    conv: Any
    norm: Any
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        y = nn.relu(self.norm()(self.conv(self.filters, (1, 1))(x)))
        y = nn.relu(self.norm()(self.conv(self.filters, (3, 3), self.strides)(y)))
        y = self.norm(scale_init=nn.initializers.zeros_init())(
            self.conv(4 * self.filters, (1, 1))(y))
        if x.shape != y.shape:
            x = self.conv(4 * self.filters, (1, 1), self.strides, name="conv_proj")(x)
            x = self.norm(name="norm_proj")(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    """ResNet v1 with bottleneck blocks; ``dtype`` is the computation's dtype (the
    parameters stay float32)."""

    stages: Sequence[int]
    num_classes: int
    filters: int = 64
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                                 epsilon=1e-5, dtype=self.dtype)
        x = conv(self.filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
        x = nn.relu(norm(name="bn_init")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, blocks in enumerate(self.stages):
            for j in range(blocks):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = Bottleneck(self.filters * 2 ** i, conv, norm, strides)(x)
        x = jnp.mean(x, axis=(1, 2))
        return jnp.asarray(nn.Dense(self.num_classes, dtype=self.dtype)(x), self.dtype)


def _resnet(config: ResNet50Config, dtype=jnp.float32) -> ResNet:
    return ResNet(stages=config.stages, num_classes=config.num_classes, filters=config.filters,
                  dtype=dtype)


def init_resnet50(key: jax.Array, config: ResNet50Config) -> Params:
    """Float32 parameters (no batch statistics) of the ResNet of ``config``."""
    images = jnp.zeros((1, config.image_size, config.image_size, 3), jnp.float32)
    return _resnet(config).init(key, images, train=False)["params"]


def resnet50_loss(params: Params, images: jax.Array, labels: jax.Array,
                  config: ResNet50Config, dtype=jnp.float32) -> jax.Array:
    """Mean cross-entropy (in float32) of a training-mode step on ``[B, H, W, 3]`` images;
    ``dtype=jnp.bfloat16`` is the hand-written twin (Flax's own mixed precision).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> params = init_resnet50(jax.random.key(0), RESNET50_TINY)
        >>> images, labels = jnp.zeros((2, 32, 32, 3)), jnp.zeros((2,), jnp.int32)
        >>> resnet50_loss(params, images, labels, RESNET50_TINY).dtype
        dtype('float32')
    """
    with jax.numpy_dtype_promotion("standard"):  # Flax's batch norm promotes bf16 with f32
        logits, _ = _resnet(config, dtype).apply({"params": params}, images, train=True,
                                                 mutable=["batch_stats"])
    return _cross_entropy(logits, labels)


def _images(config: ResNet50Config) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    size = config.image_size
    return (jax.ShapeDtypeStruct((config.batch, size, size, 3), jnp.float32),
            jax.ShapeDtypeStruct((config.batch,), jnp.int32))


# --- A MaxText-style scanned decoder, Flax linen ------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm with float32 statistics, the result in the input's dtype."""

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones_init(), (x.shape[-1],), jnp.float32)
        return rms_norm(scale.astype(x.dtype), x)


class LlamaLayer(nn.Module):
    """One LLaMA layer as a scan body: ``(carry, None) -> (carry, None)``."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x, _):
        c = self.config
        batch, tokens, width = x.shape
        dense = functools.partial(nn.Dense, use_bias=False)
        split = lambda y: y.reshape(batch, tokens, c.heads, width // c.heads)  # noqa: E731
        h = RMSNorm(name="attn_norm")(x)
        q, k, v = (split(dense(width, name=n)(h)) for n in ("query", "key", "value"))
        out = causal_attention(rope(q), rope(k), v).reshape(batch, tokens, width)
        x = x + dense(width, name="out")(out)
        h = RMSNorm(name="ffn_norm")(x)
        gated = nn.silu(dense(c.ffn, name="gate")(h)) * dense(c.ffn, name="up")(h)
        return x + dense(width, name="down")(gated), None


class ScannedDecoder(nn.Module):
    """Embedding, ``config.depth`` LLaMA layers under ``nn.remat`` inside ``nn.scan`` (the
    parameters stacked on a leading layer axis), a final norm and an untied head."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, tokens):
        c = self.config
        embed = self.param("embed", nn.initializers.normal(0.02), (c.vocab, c.width),
                           jnp.float32)
        x = embed[tokens]
        layer = nn.remat(LlamaLayer, prevent_cse=False,
                         policy=jax.checkpoint_policies.nothing_saveable)
        x, _ = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=c.depth)(c, name="layers")(x, None)
        x = RMSNorm(name="norm")(x)
        return nn.Dense(c.vocab, use_bias=False, name="head")(x)


# The memory measurement (4 layers, width 128; CPU), a GPU-sized one and a tiny one.
SCAN_SMALL = LlamaConfig(vocab=1024, seq=128, width=128, depth=4, heads=4, ffn=352, batch=4)
SCAN_GPU = LlamaConfig(vocab=32000, seq=2048, width=2048, depth=8, heads=16, ffn=5632,
                       batch=4)
SCAN_TINY = LlamaConfig(vocab=256, seq=32, width=64, depth=2, heads=4, ffn=176, batch=2)


def init_scan_decoder(key: jax.Array, config: LlamaConfig) -> Params:
    """Float32 parameters of the scanned decoder (its layers' stacked under ``layers``)."""
    tokens = jnp.zeros((1, config.seq), jnp.int32)
    return ScannedDecoder(config).init(key, tokens)["params"]


def scan_decoder_loss(params: Params, tokens: jax.Array, labels: jax.Array,
                      config: LlamaConfig) -> jax.Array:
    """Mean next-token cross-entropy (in float32) of the scanned decoder.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> params = init_scan_decoder(jax.random.key(0), SCAN_TINY)
        >>> params["layers"]["gate"]["kernel"].shape  # stacked: [layers, width, ffn]
        (2, 64, 176)
        >>> tokens = jnp.zeros((2, 32), jnp.int32)
        >>> scan_decoder_loss(params, tokens, tokens, SCAN_TINY).dtype
        dtype('float32')
    """
    return _cross_entropy(ScannedDecoder(config).apply({"params": params}, tokens), labels)


# --- The table ---------------------------------------------------------------------------


def _transformer(loss, init, config) -> Spec:
    return Spec(functools.partial(loss, config=config), functools.partial(init, config=config),
                _tokens(config), config)


def spec(name: str, quick: bool = False) -> Spec:
    """The :class:`Spec` of a model of :data:`SPECS` (``quick``: its tiny configuration)."""
    if name == "llama":
        return _transformer(llama_loss, init_llama, LLAMA_TINY if quick else LLAMA_7B_BLOCK)
    if name == "gpt_small":
        config = models.GPT_TINY if quick else GPT_SMALL
        return _transformer(models.gpt_loss, models.init_gpt, config)
    if name in ("scan_decoder", "scan_decoder_small"):
        config = SCAN_TINY if quick else SCAN_GPU if name == "scan_decoder" else SCAN_SMALL
        return _transformer(scan_decoder_loss, init_scan_decoder, config)
    if name == "resnet50":
        config = RESNET50_TINY if quick else RESNET50
        return Spec(functools.partial(resnet50_loss, config=config),
                    functools.partial(init_resnet50, config=config), _images(config), config,
                    hand_loss=functools.partial(resnet50_loss, config=config,
                                                dtype=jnp.bfloat16))
    raise ValueError(f"unknown model {name!r}; the models are {SPECS}")


GPT_SMALL = models.GPTConfig(vocab=32000, seq=1024, width=768, depth=4, heads=12, batch=8)
SPECS = ("llama", "gpt_small", "resnet50", "scan_decoder", "scan_decoder_small")
