"""Models, losses, checks and fixtures that several test files share.

Test files import it as ``from tests import helpers``; its fixtures need no import
(conftest.py loads this module as a plugin). ``tests`` is a namespace package found on
``sys.path``: pytest puts the directory of the root ``conftest.py`` there, as it does for
``benchmarks`` and ``examples``, so this works from a clean clone and under ``pytest -n auto``.
A helper lives here only when the files that use it need exactly the same thing; a variant
(another activation, another initialisation) stays in its file.
"""

import doctest
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp


def mlp_loss(params, x, y):
    """Cross-entropy of a GELU MLP (``params``: a list of ``{"w", "b"}`` layers) on labels ``y``.

    Example:
        >>> params = [{"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}]
        >>> round(float(mlp_loss(params, jnp.ones((4, 3)), jnp.zeros(4, jnp.int32))), 4)
        0.6931
    """
    for layer in params[:-1]:
        x = jax.nn.gelu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=-1))


def matmul(w, x):
    """``x @ w``: the one product of a test, as a named function (its name shows in jaxprs)."""
    return x @ w


def matmul_loss(w, x):
    """The mean square of ``x @ w``: a loss with one product and a gradient."""
    return jnp.mean((x @ w) ** 2)


def rel(a, b, axis=None):
    """The relative error ``|a - b| / |b|`` (2-norms, in float64), along ``axis`` or overall."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b, axis=axis) / np.linalg.norm(b, axis=axis)


def assert_bitwise(a, b):
    """``a`` and ``b`` are the same tree of arrays with the same dtypes, shapes and bits."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.atleast_1d(np.asarray(x)), np.atleast_1d(np.asarray(y))
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


@pytest.fixture
def standard_promotion():
    """Runs a test under JAX's default dtype promotion, as user code is written.

    The rest of the suite runs under strict promotion (conftest.py). A test file of user code
    (models written as framework users write them) makes it apply to all its tests with
    ``pytestmark = pytest.mark.usefixtures("standard_promotion")`` (conftest.py loads this
    module as a plugin, so its fixtures are known to every test file).
    """
    with jax.numpy_dtype_promotion("standard"):
        yield


def public_names():
    """Every public name, relative to jaxmp: ``mp_grad``, ``debug.find_nonfinite``, ...

    The names of ``__all__`` of ``jaxmp``, ``jaxmp.debug`` and ``jaxmp.experimental``, so that a
    name added later is covered.
    """
    return [*jaxmp.__all__, *(f"debug.{name}" for name in jaxmp.debug.__all__),
            *(f"experimental.{name}" for name in jaxmp.experimental.__all__)]


def examples_of(name):
    """``(test name, docstring)`` of ``jaxmp.<name>`` and its methods, those with examples."""
    obj = jaxmp
    for part in name.split("."):
        obj = getattr(obj, part)
    finder = doctest.DocTestFinder(recurse=inspect.isclass(obj))
    tests = finder.find(obj, f"jaxmp.{name}", module=False, globs={})
    return [(t.name, t.docstring) for t in tests if t.examples]


def public_examples():
    """``(test name, docstring)`` of every public name's examples (tests/test_docstrings.py)."""
    return [pair for name in sorted(public_names()) for pair in examples_of(name)]


class GraphsTuple(NamedTuple):
    """A batch of graphs laid out as jraph lays it out (jraph itself is not a dependency)."""

    nodes: Any
    edges: Any
    senders: Any
    receivers: Any
    globals: Any
    n_node: Any
    n_edge: Any


def graph_batch(seed: int = 0) -> GraphsTuple:
    """Two graphs of 4 and 6 nodes and 10 edges each, as NumPy arrays: float32 features, and
    NumPy's default ``int64`` indices and counts (``np.arange``-style), no globals."""
    rng = np.random.default_rng(seed)
    n_node, n_edge = np.array([4, 6]), np.array([10, 10])
    return GraphsTuple(nodes=rng.normal(size=(10, 8)).astype(np.float32),
                       edges=rng.normal(size=(20, 4)).astype(np.float32),
                       senders=rng.integers(0, 10, 20), receivers=np.arange(20) % 10,
                       globals=None, n_node=n_node, n_edge=n_edge)


def _graph_net(graph: GraphsTuple):
    """One round of message passing on ``graph`` (edges, then nodes, then globals), then a
    linear read-out per graph: the global update's MLP holds most of the FLOPs."""
    import haiku as hk  # pylint: disable=import-outside-toplevel
    sent, received = graph.nodes[graph.senders], graph.nodes[graph.receivers]
    edges = hk.Linear(8)(jnp.concatenate([graph.edges, sent, received], -1))
    n = graph.nodes.shape[0]
    nodes = hk.Linear(8)(jnp.concatenate(
        [graph.nodes, jax.ops.segment_sum(edges, graph.receivers, num_segments=n)], -1))
    n_graph = graph.n_node.shape[0]
    node_graph = jnp.repeat(jnp.arange(n_graph), graph.n_node, total_repeat_length=n)
    pooled = jax.ops.segment_sum(nodes, node_graph, num_segments=n_graph)
    glob = hk.Linear(64)(jnp.concatenate([graph.globals, pooled], -1))
    return hk.Linear(1)(jax.nn.relu(hk.Linear(64)(jax.nn.relu(glob))))


def _graph_model(graph: GraphsTuple):
    """Embeds the features, then runs the net with zero globals made inside the model."""
    import haiku as hk  # pylint: disable=import-outside-toplevel
    graph = graph._replace(globals=jnp.zeros((graph.n_node.shape[0], 64)))
    embedded = graph._replace(nodes=hk.Linear(8)(graph.nodes), edges=hk.Linear(8)(graph.edges))
    return _graph_net(embedded)


def graph_net():
    """``(loss, params, state, graph, targets)``: a Haiku ``transform_with_state`` graph net,
    jraph-style, whose model makes its float32 globals itself (``jnp.zeros``), and its mean
    square error (with the updated state as ``aux``) on :func:`graph_batch`; the parameters
    and state as shapes (``jax.ShapeDtypeStruct``), to trace with."""
    import haiku as hk  # pylint: disable=import-outside-toplevel
    model = hk.transform_with_state(_graph_model)
    graph = graph_batch()
    params, state = jax.eval_shape(model.init, jax.random.key(0), graph)  # nothing compiled

    def loss(params, state, graph, targets):
        out, state = model.apply(params, state, None, graph)
        return jnp.mean((out - targets) ** 2), state

    return loss, params, state, graph, np.linspace(-1, 1, 2, dtype=np.float32)[:, None]


def graph_zeros_line() -> str:
    """Where :func:`graph_net`'s model makes its float32 globals (``jnp.zeros``), as jaxmp's
    messages name a line: ``helpers.py:<line> (_graph_model)``."""
    lines, first = inspect.getsourcelines(_graph_model)
    return f"helpers.py:{first + next(i for i, t in enumerate(lines) if 'jnp.zeros(' in t)} " \
           "(_graph_model)"


def batch_norm_conv_net(framework: str = "flax", dtype: Any = jnp.float32,
                        stages: tuple = (8, 16), batch: int = 8, size: int = 8):
    """A tiny ResNet-style conv net with batch norm in train mode, written as its framework's
    users write it: ``(loss, params, state, images, labels)``, ``loss(params, state, images,
    labels) -> (loss, new_state)``.

    ``"flax"``: linen as google/flax's ``examples/imagenet`` writes it (convolutions without
    bias, ``nn.BatchNorm`` with ``mutable=["batch_stats"]``, residual blocks with a projection
    where the shape changes, average pooling); ``dtype=jnp.bfloat16`` sets the modules'
    ``dtype``: the hand-written bfloat16 twin (statistics in float32, normalised activations
    in bfloat16). ``"haiku"``: the same layers with ``hk.BatchNorm`` under
    ``hk.transform_with_state``.
    """
    import functools  # pylint: disable=import-outside-toplevel

    images = jax.random.normal(jax.random.key(1), (batch, size, size, 3))
    labels = jnp.arange(batch) % 10
    if framework == "flax":
        import flax.linen as nn  # pylint: disable=import-outside-toplevel

        conv = functools.partial(nn.Conv, use_bias=False, dtype=dtype)
        norm = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9,
                                 epsilon=1e-5, dtype=dtype)
        dense = functools.partial(nn.Dense, dtype=dtype)
    else:
        import haiku as hk  # pylint: disable=import-outside-toplevel

        def conv(features, kernel, strides=(1, 1)):
            return hk.Conv2D(features, kernel, strides, with_bias=False)

        def norm():
            return lambda x: hk.BatchNorm(True, True, 0.9, eps=1e-5)(x, is_training=True)

        dense = hk.Linear

    def net(x):
        x = jax.nn.relu(norm()(conv(stages[0], (3, 3))(x)))
        for i, features in enumerate(stages):
            strides = (2, 2) if i else (1, 1)
            y = jax.nn.relu(norm()(conv(features, (3, 3), strides)(x)))
            y = norm()(conv(features, (3, 3))(y))
            if x.shape != y.shape:
                x = norm()(conv(features, (1, 1), strides)(x))
            x = jax.nn.relu(x + y)
        return dense(10)(jnp.mean(x, axis=(1, 2)))

    def cross_entropy(logits, labels):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))

    if framework == "flax":
        class Net(nn.Module):
            @nn.compact
            def __call__(self, x):
                return net(x)

        model = Net()
        variables = model.init(jax.random.key(0), images)

        def loss(params, state, images, labels):
            logits, new = model.apply({"params": params, "batch_stats": state}, images,
                                      mutable=["batch_stats"])
            return cross_entropy(logits, labels), new["batch_stats"]

        return loss, variables["params"], variables["batch_stats"], images, labels
    model = hk.transform_with_state(net)
    params, state = model.init(jax.random.key(0), images)

    def haiku_loss(params, state, images, labels):
        logits, new = model.apply(params, state, None, images)
        return cross_entropy(logits, labels), new

    return haiku_loss, params, state, images, labels
