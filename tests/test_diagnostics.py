"""Tests of jaxmp._src.diagnostics."""

import jax
import jax.numpy as jnp
import pytest

import jaxmp


def _mlp_loss(params, x):
    h = jnp.tanh(x @ params["w1"])
    return jnp.mean(h @ params["w2"])


def _params():
    return {"w1": jnp.ones((16, 32)), "w2": jnp.ones((32, 4))}


def test_saved_bytes_halve_in_half_precision():
    params, x = _params(), jnp.ones((64, 16))
    full = jaxmp.debug.saved_activation_bytes(_mlp_loss, params, x)
    half = jaxmp.debug.saved_activation_bytes(jaxmp.cast_function(_mlp_loss, jnp.float16),
                                              params, x)
    assert full > 0 and full == 2 * half


def test_saved_bytes_grow_with_batch_and_accept_shape_structs():
    params = _params()
    small = jaxmp.debug.saved_activation_bytes(_mlp_loss, params,
                                               jax.ShapeDtypeStruct((8, 16), jnp.float32))
    big = jaxmp.debug.saved_activation_bytes(_mlp_loss, params,
                                             jax.ShapeDtypeStruct((800, 16), jnp.float32))
    # tanh saves its [B, 32] output: 32 * 4 bytes per extra example at least.
    assert big - small >= 792 * 32 * 4


def test_saved_bytes_with_aux_static_args_and_argnums():
    def loss(params, x, scale_name, *, power):
        y = jnp.sum(jnp.sin(x @ params["w1"]) ** power)
        return y, {"name": scale_name}

    params, x = _params(), jnp.ones((4, 16))
    by_params = jaxmp.debug.saved_activation_bytes(loss, params, x, "s", has_aux=True, power=2)
    by_both = jaxmp.debug.saved_activation_bytes(loss, params, x, "s", argnums=(0, 1),
                                                 has_aux=True, power=2)
    assert by_params > 0 and by_both >= by_params


def test_matmul_flops_counts_dots_and_convolutions():
    def f(w, x, k):
        y = x.astype(jnp.float16) @ w.astype(jnp.float16)  # 2*2*4*3 = 48 flops
        z = jax.lax.conv_general_dilated(k, k, (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        e = jnp.einsum("bij,bjk->bik", x[None], x.T[None])  # 2*1*2*2*4 = 32 flops
        return jnp.sum(y.astype(jnp.float32)) + jnp.sum(z) + jnp.sum(e)

    # conv: 81 outputs, each 3*3*3 = 27 multiply-adds -> 4374 flops
    flops = jaxmp.debug.matmul_flops(f, jnp.ones((4, 3)), jnp.ones((2, 4)), jnp.ones((3, 3, 3, 3)))
    assert flops == {"float16": 48, "float32": 4374 + 32}


def test_a_nested_jit_called_twice_is_counted_twice():
    # JAX lowers both calls to one private function: its products count once per call.
    w, x = jnp.ones((64, 32)), jnp.ones((16, 64))
    layer = jax.jit(lambda w, x: x @ w)
    flops = 2 * 16 * 32 * 64
    for platform in ("cuda", "cpu"):
        assert jaxmp.debug.matmul_flops(lambda w, x: layer(w, x) + layer(w, 2 * x), w, x,
                                        platform=platform) == {"float32": 2 * flops}


def _nested_scans(w, xs):
    def body(c, x):
        c, _ = jax.lax.scan(lambda c2, y: (c2 + y @ w, None), c, jnp.stack([x, x]))
        return c @ w, None
    return jax.lax.scan(body, jnp.ones((2, 4)), xs)[0]


ONE = 2 * 2 * 4 * 4  # one (2, 4) @ (4, 4) product
W, XS = jnp.ones((4, 4)), jnp.ones((5, 2, 4))
LOOPS = {  # (function, arguments, FLOPs): a loop body counts once per iteration when counted
    "nested scans": (_nested_scans, (W, XS), 5 * 3 * ONE),
    "reversed unrolled scan": (lambda w, xs: jax.lax.scan(
        lambda c, x: (c @ w + x, None), xs[0], xs, reverse=True, unroll=2)[0], (W, XS), 5 * ONE),
    "fori_loop 2 to 5": (lambda w, xs: jax.lax.fori_loop(2, 5, lambda i, c: c @ w, xs[0]),
                         (W, XS), 3 * ONE),
    "fori_loop to a traced bound": (lambda w, xs, n: jax.lax.fori_loop(
        0, n, lambda i, c: c @ w, xs[0]), (W, XS, jnp.asarray(3)), ONE),
    "while_loop counting to 3": (lambda w, xs: jax.lax.while_loop(
        lambda c: 3 > c[0], lambda c: (1 + c[0], c[1] @ w), (0, xs[0]))[1], (W, XS), 3 * ONE),
    "while_loop by 2": (lambda w, xs: jax.lax.while_loop(
        lambda c: c[0] < 4, lambda c: (c[0] + 2, c[1] @ w), (0, xs[0]))[1], (W, XS), ONE),
    "while_loop from 1": (lambda w, xs: jax.lax.while_loop(
        lambda c: c[0] < 4, lambda c: (c[0] + 1, c[1] @ w), (1, xs[0]))[1], (W, XS), ONE),
    "gradient of a scan": (jax.grad(lambda w, xs: jax.lax.scan(
        lambda c, x: (jnp.tanh(c @ w + x), None), xs[0], xs)[0].sum()), (W, XS), 3 * 5 * ONE),
}


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_flop_tools_agree_on_loops(loop):
    # Issue 34: matmul_flops counted a scan's body once, precision_report once per iteration.
    fn, args, flops = LOOPS[loop]
    assert jaxmp.debug.matmul_flops(fn, *args) == {"float32": flops}
    assert jaxmp.debug.precision_report(fn, *args).totals == {"float32": flops}


def test_flop_shares_agree_on_a_training_run_in_one_jit():
    # The rollout's forward product runs in float32 outside the jaxmp step, once per step of a
    # scan of 6; the step's products in bfloat16, in a scan of 3 epochs of 2 minibatches.
    grad_fn = jaxmp.mp_value_and_grad(lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2),
                                      compute_dtype=jnp.bfloat16)

    def minibatch(carry, x):
        w, scaler = carry
        _, g, scaler, _ = grad_fn(w, x, scaler_state=scaler)
        return (w - 0.1 * g, scaler), None

    def run(w, x):
        rollout, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=6)
        epoch = lambda c, _: jax.lax.scan(minibatch, c, rollout.reshape(2, 4, 8))
        return jax.lax.scan(epoch, (w, jaxmp.noop_scaler()), None, length=3)[0][0]

    w, x = jnp.ones((8, 8)) / 8, jnp.ones((8, 8))
    product = 2 * 4 * 8 * 8  # a minibatch's forward product; its backward has one (w's)
    expected = {"float32": 6 * 2 * 8 * 8 * 8, "bfloat16": 3 * 2 * 2 * product}
    assert jaxmp.debug.matmul_flops(run, w, x) == expected
    assert jaxmp.debug.precision_report(run, w, x).totals == expected
    share = expected["bfloat16"] / sum(expected.values())
    assert jaxmp.debug.half_matmul_flop_share(run, w, x) == pytest.approx(share)


@pytest.mark.filterwarnings("ignore::jaxmp.experimental.Float8ShortfallWarning")
def test_matmul_flops_takes_a_pmapped_step_and_its_outputs():
    # Issue 34: a pmapped Haiku MXFP8 step's own outputs (placed by pmap) raised "mesh should
    # be the same across the entire program" in the jit that matmul_flops lowers.
    import haiku as hk  # pylint: disable=g-import-not-at-top

    net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([32, 32], name="mlp")(x)))
    x = jnp.ones((2, 32, 32))  # 32 examples a device: the weight gradients are not padded
    params = net.init(jax.random.key(0), x[0])
    grad_fn = jaxmp.mp_value_and_grad(lambda p, x: jnp.mean(net.apply(p, x) ** 2),
                                      compute_dtype=jnp.bfloat16, axis_name="d",
                                      matmul_dtype=jnp.float8_e4m3fn, float8_scaling="mxfp8")
    step = jax.pmap(lambda p, x: grad_fn(p, x, scaler_state=jaxmp.noop_scaler())[1],
                    axis_name="d", devices=jax.devices()[:2])
    placed = jax.pmap(lambda t: t, devices=jax.devices()[:2])(
        (jax.tree.map(lambda a: jnp.stack([a, a]), params), x))
    flops = 2 * 32 * 32 * 32  # one layer's forward product, per device
    # Two layers: forward and weight gradient each, and the second layer's input gradient.
    assert jaxmp.debug.matmul_flops(step, *placed) == {"float8_e4m3fn": 5 * flops}
    assert jaxmp.debug.matmul_flops(step, *placed, platform="cpu") == {"float8_e4m3fn": 5 * flops}


def test_block_scaled_float8_products_are_counted_on_cuda():
    # On CUDA an MXFP8 product is cuDNN's block-scaled dot (a custom call), on CPU float8
    # dot_generals per block: the same FLOPs, forward and backward, under float8 either way.
    f = jaxmp.autocast(lambda w, x: x @ w, jnp.bfloat16, matmul_dtype=jnp.float8_e4m3fn,
                       float8_scaling="mxfp8")
    w, x = jnp.ones((64, 32)), jnp.ones((16, 64))
    step = jax.grad(lambda w, x: jnp.sum(f(w, x) + f(w, 2 * x)), argnums=(0, 1))
    cuda = jaxmp.debug.matmul_flops(step, w, x)
    assert cuda == jaxmp.debug.matmul_flops(step, w, x, platform="cpu")
    assert cuda == {"float8_e4m3fn": 6 * 2 * 16 * 32 * 64}  # 2 products, each 3 times
    assert jaxmp.debug.half_matmul_flop_share(step, w, x) == 1.0


def test_operand_dtype_not_accumulation_dtype_is_counted():
    flops = jaxmp.debug.matmul_flops(
        lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.float32),
        jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 2), jnp.bfloat16))
    assert flops == {"bfloat16": 24}


def test_half_share_of_a_mixed_training_step():
    params, x = _params(), jnp.ones((8, 16))

    def step(params, x, state):
        return jaxmp.mp_value_and_grad(_mlp_loss,
                                       compute_dtype=jnp.float16)(params, x, scaler_state=state)

    state = jaxmp.init_scaler()
    assert jaxmp.debug.half_matmul_flop_share(step, params, x, state) == 1.0
    assert jaxmp.debug.half_matmul_flop_share(jax.value_and_grad(_mlp_loss), params, x) == 0.0
    assert jaxmp.debug.half_matmul_flop_share(lambda v: v + 1, x) == 0.0


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
def test_lowering_platforms(platform):
    flops = jaxmp.debug.matmul_flops(lambda a: a @ a, jnp.ones((4, 4)), platform=platform)
    assert flops == {"float32": 2 * 4 * 4 * 4}


def _equinox_step_and_model():
    eqx = pytest.importorskip("equinox")
    # The activation is a custom_jvp (jax.nn.relu): a leaf that is no JAX type.
    model = eqx.nn.MLP(4, 2, 8, 1, activation=jax.nn.relu, key=jax.random.PRNGKey(0))

    def loss_fn(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    def step(model, x, grad_fn=eqx.filter_value_and_grad(loss_fn)):
        loss, grads = grad_fn(model, x)
        return eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.1 * g, grads)), loss

    return eqx, model, loss_fn, step


def test_flop_tools_take_an_equinox_step_that_returns_the_updated_module():
    eqx, model, loss_fn, step = _equinox_step_and_model()
    x = jnp.ones((3, 4))
    # Forward 2*3*(4*8 + 8*2) = 288, both weight gradients 288, one input gradient 96.
    assert jaxmp.debug.matmul_flops(step, model, x) == {"float32": 288 + 288 + 96}
    assert jaxmp.debug.half_matmul_flop_share(step, model, x) == 0.0

    def mixed_step(model, x, state):
        grad_fn = jaxmp.mp_value_and_grad(loss_fn, compute_dtype=jnp.bfloat16,
                                          matmul_dtype=jnp.float8_e4m3fn)
        loss, grads, state, _ = grad_fn(model, x, scaler_state=state)
        return eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.1 * g, grads)), loss

    state = jaxmp.noop_scaler()
    assert jaxmp.debug.half_matmul_flop_share(mixed_step, model, x, state) == 1.0
    assert jaxmp.debug.float8_matmul_flop_share(mixed_step, model, x, state) == 1.0


def test_flop_tools_and_saved_bytes_take_none_functions_and_strings_in_and_out():
    def f(tree, x):
        y = tree["act"](x @ tree["w"])
        return {"y": y, "none": None, "act": tree["act"], "name": tree["name"], "n": 3}

    tree = {"w": jnp.ones((4, 4)), "none": None, "act": jax.nn.relu, "name": "layer"}
    x = jnp.ones((2, 4))
    assert jaxmp.debug.matmul_flops(f, tree, x) == {"float32": 2 * 2 * 4 * 4}
    assert jaxmp.debug.half_matmul_flop_share(f, tree, x) == 0.0
    assert jaxmp.debug.float8_matmul_flop_share(f, tree, x) == 0.0
    # The bytes of the array outputs' residuals alone: none for what is not an array.
    saved = jaxmp.debug.saved_activation_bytes(f, tree, x)
    with_aux = jaxmp.debug.saved_activation_bytes(lambda t, x: (f(t, x), {"tag": "aux", "f": len}),
                                                  tree, x, has_aux=True)
    assert saved == with_aux == jaxmp.debug.saved_activation_bytes(
        lambda t, x: tree["act"](x @ t["w"]), tree, x) > 0


# --- Steps that update their state in place (Flax NNX) ------------------------------------------


def _nnx_steps(**grad_options):
    """A Flax NNX MLP and nnx.Optimizer, and one training step written four ways: in place
    returning nothing, in place returning the loss (both as the NNX docs write them, under
    nnx.jit), the latter not jitted, and functionally (nnx.split once, optax, the new state
    returned)."""
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(32, 64, rngs=rngs)
            self.out = nnx.Linear(64, 32, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))

    model = MLP(nnx.Rngs(0))
    tx = optax.adam(1e-2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def loss_fn(params, graphdef, x, y):
        logits = nnx.merge(graphdef, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    grad_fn = jaxmp.mp_value_and_grad(loss_fn, compute_dtype=jnp.bfloat16, **grad_options)

    def apply(optimizer, model, grads):
        optimizer.update(model, grads)

    def in_place(model, optimizer, x, y):
        graphdef, params = nnx.split(model, nnx.Param)
        loss, grads, _, finite = grad_fn(params, graphdef, x, y, scaler_state=jaxmp.noop_scaler())
        nnx.cond(finite, apply, lambda *_: None, optimizer, model, grads)
        return loss

    @nnx.jit
    def returns_nothing(model, optimizer, x, y):
        in_place(model, optimizer, x, y)

    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def functional(params, opt_state, x, y):
        loss, grads, _, _ = grad_fn(params, graphdef, x, y, scaler_state=jaxmp.noop_scaler())
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    x, y = jnp.ones((32, 32)), jnp.arange(32) % 32
    steps = {"nothing": (returns_nothing, (model, optimizer, x, y)),
             "loss": (nnx.jit(in_place), (model, optimizer, x, y)),
             "loss, not jitted": (in_place, (model, optimizer, x, y)),
             "functional": (functional, (params, tx.init(params), x, y))}
    return steps, model


# Forward 2*32*(32*64 + 64*32); backward both weight gradients and the hidden layer's input
# gradient (x is not differentiated): three times 2*32*32*64.
_NNX_STEP_FLOPS = 2 * 131072 + 3 * 131072
_NNX_TOOLS = {
    "matmul_flops": jaxmp.debug.matmul_flops,
    "precision_report": lambda *a: jaxmp.debug.precision_report(*a).totals,
    "half_matmul_flop_share": jaxmp.debug.half_matmul_flop_share,
    "float8_matmul_flop_share": jaxmp.debug.float8_matmul_flop_share,
}


@pytest.mark.usefixtures("standard_promotion")  # optax's Adam adds int32 counts to floats
@pytest.mark.parametrize("returns", ["nothing", "loss", "loss, not jitted"])
@pytest.mark.parametrize("tool", sorted(_NNX_TOOLS))
def test_flop_tools_count_an_nnx_step_that_updates_in_place(tool, returns):
    # Before: {} for the step that returns nothing, the forward pass alone for the other.
    options = {"matmul_dtype": jnp.float8_e4m3fn} if tool.startswith("float8") else {}
    steps, model = _nnx_steps(**options)
    kernel = model.hidden.kernel[...]
    counted = _NNX_TOOLS[tool](*steps[returns][0:1], *steps[returns][1])
    assert counted == _NNX_TOOLS[tool](steps["functional"][0], *steps["functional"][1])
    if tool in ("matmul_flops", "precision_report"):
        assert counted == {"bfloat16": _NNX_STEP_FLOPS}
    else:
        assert counted == 1.0
    assert model.hidden.kernel[...] is kernel  # the model is not updated, nor left with tracers


def test_saved_bytes_of_an_nnx_module_that_is_not_a_pytree():
    nnx = pytest.importorskip("flax.nnx")

    class Layer(nnx.Module, pytree=False):  # a leaf to JAX: before, closed over and 0 bytes
        def __init__(self, rngs):
            self.linear = nnx.Linear(16, 8, rngs=rngs)

        def __call__(self, x):
            return jnp.tanh(self.linear(x))

    layer, x = Layer(nnx.Rngs(0)), jnp.ones((4, 16))
    saved = jaxmp.debug.saved_activation_bytes(lambda m, x: jnp.sum(m(x)), layer, x)
    w = {"w": layer.linear.kernel[...], "b": layer.linear.bias[...]}
    assert saved == jaxmp.debug.saved_activation_bytes(
        lambda w, x: jnp.sum(jnp.tanh(x @ w["w"] + w["b"])), w, x) > 0


@pytest.mark.parametrize("tool", ["matmul_flops", "precision_report"])
def test_flop_tools_refuse_a_step_that_keeps_its_results_in_python_state(tool):
    state = {}

    def step(w, x):  # updates a dict it closes over, returns nothing: every product is dead
        state["w"] = w - 0.1 * jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)

    with pytest.raises(ValueError, match="counted no FLOPs.*must return that state"):
        getattr(jaxmp.debug, tool)(step, jnp.ones((8, 8)), jnp.ones((4, 8)))


@pytest.mark.gpu_program
@pytest.mark.usefixtures("standard_promotion")
def test_gpu_program_counts_an_nnx_step_that_updates_in_place():
    from jaxmp._src import gpu_program  # pylint: disable=import-outside-toplevel
    if not gpu_program.plugin_installed():
        pytest.skip("needs JAX's CUDA plugin: pip install -e '.[gpu-compile]'")
    steps, _ = _nnx_steps()
    step, args = steps["loss, not jitted"]  # before: the forward pass alone
    program = jaxmp.debug.gpu_program(step, *args, target="h100")
    assert program.requested_flops == {"bfloat16": _NNX_STEP_FLOPS}
    assert sum(program.matmul_flops().values()) == _NNX_STEP_FLOPS


def test_flop_tools_take_an_nnx_variable_argument():
    """An nnx.Variable passed on its own (a step counter, a scale) is a graph node whose state is
    its value, not an nnx.State (it raised 'len() of unsized object')."""
    nnx = pytest.importorskip("flax.nnx")
    layer, count = nnx.Linear(8, 4, rngs=nnx.Rngs(0)), nnx.Variable(jnp.zeros((), jnp.int32))

    def step(layer, count, x):
        count[...] = count[...] + 1
        return jnp.sum(layer(x))

    x = jnp.ones((2, 8))
    assert jaxmp.debug.matmul_flops(step, layer, count, x) == {"float32": 2 * 2 * 8 * 4}
    assert int(count[...]) == 0  # the caller's variable is left as it was
