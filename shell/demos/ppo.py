"""PPO as PureJaxRL's ``ppo.py`` trains it, on an NNX actor-critic, in one compiled program.

The algorithm, its defaults and its logged return are PureJaxRL's (Lu et al., 2022): several
environments stepped in parallel, rollouts of ``num_steps``, generalized advantage estimation,
then ``update_epochs`` epochs of shuffled minibatch updates with the clipped objective, a
clipped value loss and an entropy bonus, Adam behind a gradient-norm clip, the learning rate
annealed linearly to zero. The update epochs are nnxscan's own pure pieces:
:func:`~nnxscan.pure.make_train_step` over the PPO loss, :func:`~nnxscan.pure.make_epoch`
over the rollout buffer with a device-side key. ``train(key)`` is the whole run; jit it,
``jax.vmap`` it over keys (seeds) or over float hyperparameters.

Everything here is pure (jax, flax, optax, nnxscan.pure): the environment is passed in, any
object with gymnax 1.0's ``reset(key, params)`` and six-value ``step(key, state, action,
params)``, so nothing imports gymnax. ``nnxscan demo ppo`` (:mod:`~nnxscan.shell.demos.ppo_demo`)
runs it on gymnax's ``CartPole-v1``.

Example:
  >>> env, env_params = gymnax.make("CartPole-v1")
  >>> train = make_ppo_train(env, env_params, PPOConfig())
  >>> run = jax.jit(jax.vmap(train))(jax.random.split(jax.random.key(0), 4))
  >>> final_return(run.metrics["episode_return"])   # one number per seed, ~500
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nnxscan.pure import init_opt_state, make_epoch, make_train_step
from nnxscan.shell.demos.ppo_policy import (
    ActorCritic,
    action_entropy,
    action_log_prob,
    sample_action,
)

__all__ = [
    "EnvCarry",
    "PPOConfig",
    "PPORun",
    "annealed_learning_rate",
    "final_return",
    "gae",
    "make_policy",
    "make_ppo_train",
    "make_rollout",
    "make_update_epochs",
    "ppo_loss",
    "ppo_optimizer",
    "reset_envs",
]


class PPOConfig(NamedTuple):
    """PureJaxRL's PPO configuration for CartPole (its defaults are these defaults).

    The int fields fix the program's shapes and must be Python ints. The float fields may
    be traced arrays: ``jax.vmap`` over one of them trains one agent per value.
    """

    num_envs: int = 4
    num_steps: int = 128
    total_timesteps: int = 500_000
    update_epochs: int = 4
    num_minibatches: int = 4
    hidden: int = 64
    learning_rate: float = 2.5e-4
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_eps: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5

    @property
    def num_updates(self) -> int:
        """Rollout-and-update rounds: ``total_timesteps // num_steps // num_envs``."""
        return self.total_timesteps // self.num_steps // self.num_envs

    @property
    def minibatch_size(self) -> int:
        return self.num_envs * self.num_steps // self.num_minibatches

    def env_steps(self) -> np.ndarray:
        """Environment steps taken by the end of each update, ``(num_updates,)``."""
        return (np.arange(self.num_updates) + 1) * self.num_steps * self.num_envs


class PPORun(NamedTuple):
    """What ``train(key)`` returns: the trained policy's ``nnx.State`` and one entry per
    update of each metric (``episode_return``, ``loss``, ``actor_loss``, ``value_loss``,
    ``entropy``); under ``jax.vmap`` every leaf gains a leading seeds axis."""

    state: nnx.State
    metrics: dict[str, jax.Array]


class Transition(NamedTuple):
    obs: jax.Array
    action: jax.Array
    log_prob: jax.Array
    value: jax.Array
    reward: jax.Array
    done: jax.Array
    episode_return: jax.Array  # the last finished episode's return (PureJaxRL's LogWrapper)


# -- advantages and the loss --------------------------------------------------------------------


def gae(
    rewards: jax.Array,
    values: jax.Array,
    dones: jax.Array,
    last_value: jax.Array,
    gamma: float,
    gae_lambda: float,
) -> tuple[jax.Array, jax.Array]:
    """Generalized advantage estimation over a rollout, time on the leading axis.

    ``done[t]`` ends the episode after step ``t`` (its next value is not bootstrapped);
    ``last_value`` is the value of the observation after the last step.

    Returns:
      ``(advantages, targets)``, both shaped like ``rewards``; ``targets = advantages +
      values`` are the value function's regression targets.

    Example:
      >>> adv, targets = gae(rewards, values, dones, last_value, 0.99, 0.95)
    """

    def backwards(carry, step):
        advantage, next_value = carry
        reward, value, done = step
        not_done = 1.0 - done
        delta = reward + gamma * next_value * not_done - value
        advantage = delta + gamma * gae_lambda * not_done * advantage
        return (advantage, value), advantage

    start = (jnp.zeros_like(last_value), last_value)
    steps = (rewards, values, dones.astype(values.dtype))
    # PureJaxRL unrolls this scan 16 times; on the CPU that only lengthens the compile (~1.5 s
    # of the whole run) without speeding up the 128 tiny steps.
    _, advantages = jax.lax.scan(backwards, start, steps, reverse=True)
    return advantages, advantages + values


def ppo_loss(
    model: ActorCritic,
    batch: dict[str, jax.Array],
    *,
    clip_eps: float = 0.2,
    vf_coef: float = 0.5,
    ent_coef: float = 0.01,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO's loss on a minibatch: the clipped surrogate with minibatch-normalized
    advantages, plus ``vf_coef`` times the clipped value loss, minus ``ent_coef`` times the
    entropy.

    ``batch`` holds ``obs``, ``action``, ``log_prob`` and ``value`` (as recorded in the
    rollout), ``advantage`` and ``target`` (from :func:`gae`).

    Returns:
      ``(loss, {"actor_loss", "value_loss", "entropy"})``: the ``has_aux`` form
      :func:`~nnxscan.pure.make_train_step` takes.

    Example:
      >>> step = make_train_step(ppo_loss, tx, has_aux=True)
    """
    logits, value = model(batch["obs"])
    log_prob = action_log_prob(logits, batch["action"])

    old_value, target = batch["value"], batch["target"]
    value_clipped = old_value + jnp.clip(value - old_value, -clip_eps, clip_eps)
    value_loss = 0.5 * jnp.mean(
        jnp.maximum(jnp.square(value - target), jnp.square(value_clipped - target))
    )

    ratio = jnp.exp(log_prob - batch["log_prob"])
    advantage = batch["advantage"]
    advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    actor_loss = -jnp.mean(jnp.minimum(ratio * advantage, clipped_ratio * advantage))
    entropy = jnp.mean(action_entropy(logits))

    loss = actor_loss + vf_coef * value_loss - ent_coef * entropy
    return loss, {"actor_loss": actor_loss, "value_loss": value_loss, "entropy": entropy}


# -- the whole run ------------------------------------------------------------------------------


def _check_config(config: PPOConfig) -> PPOConfig:
    """Raises ValueError on sizes the program can't be built with; returns ``config``."""
    for name in ("num_envs", "num_steps", "total_timesteps", "update_epochs",
                 "num_minibatches", "hidden"):  # fmt: skip
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"PPOConfig.{name} must be a positive int, got {value!r}.")
    if config.num_updates < 1:
        raise ValueError(
            f"total_timesteps={config.total_timesteps} is less than one rollout "
            f"(num_envs * num_steps = {config.num_envs * config.num_steps}): raise it."
        )
    buffer = config.num_envs * config.num_steps
    if buffer % config.num_minibatches:
        raise ValueError(
            f"the rollout buffer of num_envs * num_steps = {buffer} transitions does not "
            f"split into num_minibatches={config.num_minibatches} equal minibatches: pick a "
            f"divisor of {buffer}."
        )
    return config


def make_policy(env: Any, env_params: Any, config: PPOConfig, rngs: nnx.Rngs) -> ActorCritic:
    """The :class:`ActorCritic` sized for ``env``, as ``train`` builds it: ``nnx.update`` it
    with a run's ``state`` to get the trained policy as a live module.

    Example:
      >>> policy = make_policy(env, env_params, config, nnx.Rngs(0))
      >>> nnx.update(policy, run.state)
    """
    obs_size = int(np.prod(env.observation_space(env_params).shape))
    num_actions = int(env.action_space(env_params).n)
    return ActorCritic(obs_size, num_actions, hidden=config.hidden, rngs=rngs)


def annealed_learning_rate(config: PPOConfig) -> Callable[[jax.Array], jax.Array]:
    """PureJaxRL's schedule: constant within an update, falling linearly to zero over the
    run (``count`` is the optimizer step, ``update_epochs * num_minibatches`` per update).

    Example:
      >>> annealed_learning_rate(PPOConfig())(16)   # update 1 of 976
      Array(0.00024974, dtype=float32)
    """
    steps_per_update = config.update_epochs * config.num_minibatches

    def schedule(count: jax.Array) -> jax.Array:
        return config.learning_rate * (1.0 - (count // steps_per_update) / config.num_updates)

    return schedule


def ppo_optimizer(config: PPOConfig) -> optax.GradientTransformation:
    """Adam (eps 1e-5) behind ``clip_by_global_norm(max_grad_norm)``, its learning rate
    annealed (:func:`annealed_learning_rate`) or constant, as PureJaxRL builds it.

    Example:
      >>> tx = ppo_optimizer(PPOConfig())
    """
    lr = annealed_learning_rate(config) if config.anneal_lr else config.learning_rate
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), optax.adam(lr, eps=1e-5))


def make_update_epochs(
    graphdef: nnx.GraphDef, tx: optax.GradientTransformation, config: PPOConfig
) -> Callable[..., tuple[nnx.State, Any, tuple[jax.Array, dict[str, jax.Array]]]]:
    """Builds PPO's update phase, ``update(state, opt_state, buffer, key)``: ``update_epochs``
    epochs over the rollout buffer, each a fresh permutation drawn from ``key`` cut into
    ``num_minibatches`` minibatches, one :func:`ppo_loss` step per minibatch.

    It is nnxscan's pure core and nothing else: ``make_epoch(make_train_step(ppo_loss, tx,
    has_aux=True), batch_size=minibatch_size)`` called with one key per epoch inside a
    ``lax.scan``.

    Returns:
      ``update(state, opt_state, buffer, key) -> (state, opt_state, (losses, aux))``;
      ``buffer`` is a dict of ``num_envs * num_steps`` transitions (the keys
      :func:`ppo_loss` reads); ``losses`` and each aux leaf are ``(update_epochs,
      num_minibatches)``.

    Example:
      >>> update = make_update_epochs(graphdef, ppo_optimizer(config), config)
      >>> state, opt_state, (losses, aux) = update(state, opt_state, buffer, key)
    """

    def loss_fn(model: ActorCritic, batch: dict[str, jax.Array]):
        return ppo_loss(
            model, batch,
            clip_eps=config.clip_eps, vf_coef=config.vf_coef, ent_coef=config.ent_coef,
        )  # fmt: skip

    step = make_train_step(loss_fn, tx, has_aux=True)
    epoch = make_epoch(step, batch_size=config.minibatch_size)

    def update(state, opt_state, buffer, key):
        def one_epoch(carry, key):
            state, opt_state = carry
            state, opt_state, out = epoch(graphdef, state, opt_state, buffer, key)
            return (state, opt_state), out

        keys = jax.random.split(key, config.update_epochs)
        (state, opt_state), out = jax.lax.scan(one_epoch, (state, opt_state), keys)
        return state, opt_state, out

    return update


class EnvCarry(NamedTuple):
    """The environments between rollouts: their states, observations, the return of each
    running episode and of each one's last finished episode."""

    env_state: Any
    obs: jax.Array
    running_return: jax.Array
    finished_return: jax.Array


def make_rollout(
    env: Any, env_params: Any, config: PPOConfig
) -> Callable[[ActorCritic, EnvCarry, jax.Array], tuple[EnvCarry, Transition]]:
    """Builds ``rollout(policy, envs, key) -> (envs, transitions)``: ``num_steps`` steps of
    the ``num_envs`` environments (``jax.vmap`` over them) with actions sampled from
    ``policy``, in a ``lax.scan``. Transitions are ``(num_steps, num_envs, ...)``.

    Example:
      >>> envs, traj = make_rollout(env, env_params, config)(policy, envs, key)
    """
    num_envs = config.num_envs
    step_envs = jax.vmap(env.step, in_axes=(0, 0, 0, None))

    def env_step(policy, envs: EnvCarry, keys):
        action_key, env_keys = keys
        logits, value = policy(envs.obs)
        action = sample_action(action_key, logits)
        obs, env_state, reward, terminated, truncated, _ = step_envs(
            env_keys, envs.env_state, action, env_params
        )
        done = jnp.logical_or(terminated, truncated)
        running = envs.running_return + reward
        finished = jnp.where(done, running, envs.finished_return)
        log_prob = action_log_prob(logits, action)
        transition = Transition(envs.obs, action, log_prob, value, reward, done, finished)
        return EnvCarry(env_state, obs, jnp.where(done, 0.0, running), finished), transition

    def rollout(policy, envs, key):
        # Each step's keys (one to sample the actions, one per environment) are split for
        # all steps at once, before the loop: the same keys as splitting inside each step,
        # with two fewer threefry hashes in the loop body, whose tiny ops run one by one.
        action_keys, step_keys = jax.vmap(jax.random.split, out_axes=1)(
            jax.random.split(key, config.num_steps)
        )
        env_keys = jax.vmap(lambda k: jax.random.split(k, num_envs))(step_keys)
        return jax.lax.scan(
            lambda carry, keys: env_step(policy, carry, keys), envs, (action_keys, env_keys)
        )

    return rollout


def reset_envs(env: Any, env_params: Any, config: PPOConfig, key: jax.Array) -> EnvCarry:
    """``num_envs`` freshly reset environments (``jax.vmap`` of ``env.reset``)."""
    keys = jax.random.split(key, config.num_envs)
    obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(keys, env_params)
    zeros = jnp.zeros(config.num_envs)
    return EnvCarry(env_state, obs, zeros, zeros)


def make_ppo_train(
    env: Any, env_params: Any, config: PPOConfig | None = None
) -> Callable[[jax.Array], PPORun]:
    """Builds ``train(key) -> PPORun``: a whole PPO run, pure, for one seed.

    ``train`` initializes the policy from ``key`` (:func:`make_policy`), resets
    ``num_envs`` environments, then scans ``num_updates`` rounds of: a rollout
    (:func:`make_rollout`), :func:`gae`, and the update epochs
    (:func:`make_update_epochs`, i.e. ``make_epoch`` over ``make_train_step(ppo_loss,
    ...)``) with :func:`ppo_optimizer`.

    Args:
      env, env_params: a gymnax 1.0 environment (``gymnax.make("CartPole-v1")``) with a
        discrete action space; ``terminated or truncated`` ends an episode (PureJaxRL,
        written for gymnax 0.0's single ``done``, does the same).
      config: sizes and hyperparameters (default ``PPOConfig()``); float fields may be
        traced.

    Returns:
      ``train(key)``: jit it, ``jax.vmap`` it over a stack of keys. Its ``metrics`` hold,
      per update, the mean over steps and environments of the return of each
      environment's last finished episode (0 before the first; PureJaxRL's logged
      ``returned_episode_returns``) and the losses averaged over the update's minibatches.

    Example:
      >>> train = make_ppo_train(env, env_params)
      >>> run = jax.jit(train)(jax.random.key(0))
      >>> run.metrics["episode_return"].shape
      (976,)
    """
    config = _check_config(PPOConfig() if config is None else config)
    buffer_size = config.num_envs * config.num_steps
    graphdef = nnx.graphdef(
        nnx.eval_shape(lambda: make_policy(env, env_params, config, nnx.Rngs(0)))
    )
    rollout = make_rollout(env, env_params, config)

    def train(key: jax.Array) -> PPORun:
        # Built inside: a traced float field (a vmapped learning rate) enters the schedule.
        tx = ppo_optimizer(config)
        update_epochs = make_update_epochs(graphdef, tx, config)
        init_key, reset_key, key = jax.random.split(key, 3)
        state = nnx.state(make_policy(env, env_params, config, nnx.Rngs(init_key)))
        opt_state = init_opt_state(tx, state)
        envs = reset_envs(env, env_params, config, reset_key)

        def one_update(carry, key):
            state, opt_state, envs = carry
            rollout_key, epochs_key = jax.random.split(key)
            policy = nnx.merge(graphdef, state)
            envs, traj = rollout(policy, envs, rollout_key)
            _, last_value = policy(envs.obs)
            advantage, target = gae(
                traj.reward, traj.value, traj.done, last_value, config.gamma, config.gae_lambda
            )
            buffer = {
                "obs": traj.obs, "action": traj.action, "log_prob": traj.log_prob,
                "value": traj.value, "advantage": advantage, "target": target,
            }  # fmt: skip
            buffer = jax.tree.map(lambda x: x.reshape(buffer_size, *x.shape[2:]), buffer)
            state, opt_state, (loss, aux) = update_epochs(state, opt_state, buffer, epochs_key)
            metrics = {"episode_return": traj.episode_return.mean(), "loss": loss.mean()}
            metrics |= {name: value.mean() for name, value in aux.items()}
            return (state, opt_state, envs), metrics

        keys = jax.random.split(key, config.num_updates)
        (state, _, _), metrics = jax.lax.scan(one_update, (state, opt_state, envs), keys)
        return PPORun(state, metrics)

    return train


def final_return(episode_return: Any, last: int = 10) -> np.ndarray:
    """The mean of the per-update ``episode_return`` over the last ``last`` updates (the
    trailing axis), as a numpy array: one number per seed for a vmapped run.

    Example:
      >>> final_return(run.metrics["episode_return"])
    """
    returns = np.asarray(episode_return)
    return returns[..., -last:].mean(axis=-1)
