"""A whole training run in one jit: PPO on CartPole, in float16 or bfloat16, with jaxmp.

The program has the shape of PureJaxRL's PPO (and of many research codebases): one
``jax.jit`` of a ``lax.scan`` over updates; each update collects a rollout (a scan over
environment steps), then trains on it with a scan over epochs, each a scan over shuffled
minibatches, each minibatch one jaxmp gradient step. Three things are jaxmp's:

* the gradient step: ``jaxmp.mp_value_and_grad`` then ``jaxmp.optimizer_update``, as in a
  step-by-step loop;
* the loss scaler's state rides in the scan carry with the parameters and the optimizer state
  (it must change on a skipped step too: that is where the scale goes down);
* ``jaxmp.scaler_metrics(scaler)`` is an output of the minibatch scan, so the run returns the
  loss scale, the skipped steps and any alarm *per step*, stacked ``(updates, epochs,
  minibatches)``. The state itself comes back to the host once, at the end of the run: a stuck
  period inside the run is said then, from the record the state keeps.

The policy is a small actor-critic MLP, written twice: in plain JAX (a dict of arrays) and as a
Flax linen module. Everything else is shared. The environment is CartPole's classic dynamics in
pure JAX (no gym needed). From the repository root::

    python -m examples.one_jit --framework linen --precision float32 float16 bfloat16
    python -m examples.one_jit --framework jax --updates 5        # a short run
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp

PRECISIONS = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


# --- The environment: CartPole-v1, pure JAX ------------------------------------------------

class CartPole:
    """CartPole-v1's dynamics (Barto, Sutton and Anderson, 1983), reset when an episode ends.

    The state is ``(x, x_dot, theta, theta_dot)`` plus the step in the episode; the reward is 1
    per step; an episode ends when the pole tilts past 12 degrees, the cart leaves
    ``[-2.4, 2.4]`` or after 500 steps.
    """

    gravity, cart_mass, pole_mass, half_length, force, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    max_steps, x_limit, theta_limit = 500, 2.4, 12 * 2 * np.pi / 360
    n_actions, obs_size = 2, 4

    def reset(self, key: jax.Array):
        """``(state, observation)``: near upright, at rest; the state is ``(physics, t)``."""
        physics = jax.random.uniform(key, (4,), minval=-0.05, maxval=0.05)
        return (physics, jnp.zeros((), jnp.int32)), physics

    def step(self, key, state, action):
        """``(next state, observation, reward, done)``; a finished episode starts again."""
        (x, x_dot, theta, theta_dot), t = state
        force = jnp.where(action == 1, self.force, -self.force)
        cos, sin = jnp.cos(theta), jnp.sin(theta)
        total = self.cart_mass + self.pole_mass
        lever = self.pole_mass * self.half_length
        temp = (force + lever * theta_dot**2 * sin) / total
        theta_acc = (self.gravity * sin - cos * temp) / (
            self.half_length * (4.0 / 3.0 - self.pole_mass * cos**2 / total))
        x_acc = temp - lever * theta_acc * cos / total
        physics = jnp.stack([x + self.tau * x_dot, x_dot + self.tau * x_acc,
                             theta + self.tau * theta_dot, theta_dot + self.tau * theta_acc])
        t = t + 1
        done = ((jnp.abs(physics[0]) > self.x_limit) | (jnp.abs(physics[2]) > self.theta_limit)
                | (t >= self.max_steps))
        reward = jnp.ones((), jnp.float32)
        fresh, _ = self.reset(key)
        state = jax.tree.map(lambda new, old: jnp.where(done, new, old), fresh, (physics, t))
        return state, state[0], reward, done


# --- The policy, twice: plain JAX and Flax linen ---------------------------------------------

class Model(NamedTuple):
    """A policy: ``init(key, obs) -> params`` and ``apply(params, obs) -> (logits, value)``."""

    init: Callable
    apply: Callable


def plain_jax_model(hidden: int = 64, n_actions: int = 2) -> Model:
    """The actor-critic MLP as a dict of arrays and a function."""

    def dense(key, n_in, n_out):
        return {"w": jax.random.normal(key, (n_in, n_out)) / np.sqrt(n_in),
                "b": jnp.zeros((n_out,))}

    def init(key, obs):
        k = jax.random.split(key, 6)
        sizes = [obs.shape[-1], hidden, hidden]
        return {"actor": [dense(k[i], n, m) for i, (n, m) in enumerate(zip(sizes, [
                    hidden, hidden, n_actions]))],
                "critic": [dense(k[3 + i], n, m) for i, (n, m) in enumerate(zip(sizes, [
                    hidden, hidden, 1]))]}

    def mlp(layers, x):
        for layer in layers[:-1]:
            x = jnp.tanh(x @ layer["w"] + layer["b"])
        return x @ layers[-1]["w"] + layers[-1]["b"]

    def apply(params, obs):
        return mlp(params["actor"], obs), mlp(params["critic"], obs)[..., 0]

    return Model(init, apply)


class ActorCritic(nn.Module):
    """The same actor-critic MLP as a Flax linen module (no ``dtype=``: jaxmp chooses)."""

    hidden: int = 64
    n_actions: int = 2

    @nn.compact
    def __call__(self, obs):
        def mlp(x, n_out, name):
            for i in range(2):
                x = jnp.tanh(nn.Dense(self.hidden, name=f"{name}_{i}")(x))
            return nn.Dense(n_out, name=f"{name}_out")(x)

        return mlp(obs, self.n_actions, "actor"), mlp(obs, 1, "critic")[..., 0]


def linen_model(hidden: int = 64, n_actions: int = 2) -> Model:
    module = ActorCritic(hidden, n_actions)
    return Model(lambda key, obs: module.init(key, obs)["params"],
                 lambda params, obs: module.apply({"params": params}, obs))


MODELS = {"jax": plain_jax_model, "linen": linen_model}


# --- PPO -------------------------------------------------------------------------------------

class Config(NamedTuple):
    """The run's settings (PureJaxRL's CartPole defaults, but ``updates`` and the sizes)."""

    updates: int = 50
    num_envs: int = 4
    num_steps: int = 128
    epochs: int = 4
    minibatches: int = 4
    hidden: int = 64
    learning_rate: float = 2.5e-4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    value_coef: float = 0.5
    entropy_coef: float = 0.01
    max_grad_norm: float = 0.5


class Transition(NamedTuple):
    obs: jax.Array
    action: jax.Array
    log_prob: jax.Array
    value: jax.Array
    reward: jax.Array
    done: jax.Array


def advantages(rollout: Transition, last_value: jax.Array, gamma: float, lam: float):
    """Generalised advantage estimates and value targets, by a reverse scan over the rollout."""

    def back(carry, t):
        gae, next_value = carry
        alive = 1.0 - t.done.astype(jnp.float32)
        delta = t.reward + gamma * next_value * alive - t.value
        gae = delta + gamma * lam * alive * gae
        return (gae, t.value), gae

    _, adv = jax.lax.scan(back, (jnp.zeros_like(last_value), last_value), rollout, reverse=True)
    return adv, adv + rollout.value


def ppo_loss(apply: Callable, config: Config):
    """The clipped PPO loss of one minibatch, written in plain float32 JAX."""

    def loss_fn(params, batch, adv, target):
        logits, value = apply(params, batch.obs)
        log_probs = jax.nn.log_softmax(logits)
        log_prob = jnp.take_along_axis(log_probs, batch.action[:, None], axis=-1)[:, 0]
        value_clipped = batch.value + jnp.clip(value - batch.value, -config.clip, config.clip)
        value_loss = 0.5 * jnp.maximum((value - target) ** 2, (value_clipped - target) ** 2).mean()
        ratio = jnp.exp(log_prob - batch.log_prob)
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        actor_loss = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - config.clip, 1 + config.clip)
                                  * adv).mean()
        entropy = -(jnp.exp(log_probs) * log_probs).sum(-1).mean()
        return actor_loss + config.value_coef * value_loss - config.entropy_coef * entropy

    return loss_fn


class RunState(NamedTuple):
    """The scan carry of the whole run: the scaler state rides with the parameters."""

    params: Any
    opt_state: Any
    scaler: jaxmp.ScalerState
    env_state: Any
    obs: jax.Array
    episode_return: jax.Array
    key: jax.Array


def make_train(model: Model, config: Config, compute_dtype: Any, env: CartPole | None = None):
    """``train(key, scaler) -> (final RunState, metrics)``: the whole run, to ``jax.jit`` once.

    ``metrics["step"]`` holds the loss, ``finite`` and ``jaxmp.scaler_metrics`` of every
    gradient step, shaped ``(updates, epochs, minibatches)``; ``metrics["update"]`` the mean
    return of the episodes finished in each update's rollout.
    """
    env = CartPole() if env is None else env
    optimizer = optax.chain(optax.clip_by_global_norm(config.max_grad_norm),
                            optax.adam(config.learning_rate, eps=1e-5))
    grad_fn = jaxmp.mp_value_and_grad(
        ppo_loss(model.apply, config), compute_dtype=compute_dtype,
        use_mixed_precision=jnp.dtype(compute_dtype) != jnp.float32)
    batch_size = config.num_envs * config.num_steps
    minibatch = batch_size // config.minibatches

    def env_step(run: RunState, _):
        """One step of every environment; the policy runs in float32 (outside the gradient)."""
        key, k_act, k_env = jax.random.split(run.key, 3)
        obs = run.obs  # the observation the action is taken on
        logits, value = model.apply(run.params, obs)
        action = jax.random.categorical(k_act, logits)
        log_prob = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], -1)[:, 0]
        env_state, next_obs, reward, done = jax.vmap(env.step)(
            jax.random.split(k_env, config.num_envs), run.env_state, action)
        ret = run.episode_return + reward
        finished = (jnp.where(done, ret, 0.0).sum(), done.sum(dtype=jnp.float32))
        run = run._replace(env_state=env_state, obs=next_obs, key=key,
                           episode_return=jnp.where(done, 0.0, ret))
        return run, (Transition(obs, action, log_prob, value, reward, done), finished)

    def minibatch_step(carry, batch):
        """One jaxmp gradient step: the scaler state goes in and comes out with the rest."""
        params, opt_state, scaler = carry
        loss, grads, scaler, finite = grad_fn(params, *batch, scaler_state=scaler)
        params, opt_state = jaxmp.optimizer_update(params, optimizer, opt_state, grads, finite)
        return (params, opt_state, scaler), {"loss": loss, "finite": finite,
                                             **jaxmp.scaler_metrics(scaler)}

    def epoch(carry, key, data):
        """One pass over the rollout in shuffled minibatches (a scan over them)."""
        order = jax.random.permutation(key, batch_size)
        shuffled = jax.tree.map(
            lambda x: x.reshape(batch_size, *x.shape[2:])[order].reshape(
                config.minibatches, minibatch, *x.shape[2:]), data)
        return jax.lax.scan(minibatch_step, carry, shuffled)

    def update(run: RunState, _):
        """Collect a rollout, then train on it for ``epochs`` epochs (a scan over epochs)."""
        run, (rollout, finished) = jax.lax.scan(env_step, run, None, config.num_steps)
        _, last_value = model.apply(run.params, run.obs)
        adv, target = advantages(rollout, last_value, config.gamma, config.gae_lambda)
        key, k_epochs = jax.random.split(run.key)
        carry = (run.params, run.opt_state, run.scaler)
        carry, step_metrics = jax.lax.scan(
            lambda c, k: epoch(c, k, (rollout, adv, target)),
            carry, jax.random.split(k_epochs, config.epochs))
        params, opt_state, scaler = carry
        returns, episodes = (x.sum() for x in finished)
        run = run._replace(params=params, opt_state=opt_state, scaler=scaler, key=key)
        return run, {"step": step_metrics,
                     "update": {"mean_return": returns / jnp.maximum(episodes, 1),
                                "episodes": episodes}}

    def train(key: jax.Array, scaler: jaxmp.ScalerState):
        k_init, k_env, k_run = jax.random.split(key, 3)
        env_state, obs = jax.vmap(env.reset)(jax.random.split(k_env, config.num_envs))
        params = model.init(k_init, obs)
        run = RunState(params, optimizer.init(params), scaler, env_state, obs,
                       jnp.zeros((config.num_envs,)), k_run)
        return jax.lax.scan(update, run, None, config.updates)

    return train


# --- The command line ------------------------------------------------------------------------

def run(framework: str, precision: str, config: Config, seed: int = 0):
    """Compiles and runs the whole run once; returns ``(final RunState, metrics, seconds)``."""
    dtype = PRECISIONS[precision]
    train = jax.jit(make_train(MODELS[framework](config.hidden), config, dtype))
    start = time.perf_counter()
    final, metrics = jax.block_until_ready(train(jax.random.key(seed), jaxmp.scaler_for(dtype)))
    return final, metrics, time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m examples.one_jit",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--framework", choices=sorted(MODELS), default="linen")
    parser.add_argument("--precision", nargs="+", choices=list(PRECISIONS),
                        default=["float32", "float16", "bfloat16"])
    parser.add_argument("--updates", type=int, default=Config._field_defaults["updates"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = Config(updates=args.updates)
    print(f"PPO on CartPole, {args.framework}, {config.updates} updates x {config.epochs} epochs "
          f"x {config.minibatches} minibatches, all in one jit")
    for precision in args.precision:
        final, metrics, seconds = run(args.framework, precision, config, args.seed)
        step, returns = jax.device_get((metrics["step"], metrics["update"]["mean_return"]))
        print(f"{precision:>9}: mean return of the last 5 updates {returns[-5:].mean():6.1f}, "
              f"skipped steps {int(final.scaler.skipped_steps)}, final loss scale "
              f"{float(final.scaler.scale):g}, longest run of skips "
              f"{int(final.scaler.longest_skip_run)}, {seconds:.1f} s (compilation included)")
        del step


if __name__ == "__main__":
    main()
