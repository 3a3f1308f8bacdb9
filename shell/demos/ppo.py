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

import typing
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nnxscan.pure import Step, init_opt_state, make_epoch, make_train_step
from nnxscan.shell.demos.ppo_policy import (
    ActorCritic,
    RunKey,
    action_entropy,
    action_log_prob,
    sample_action,
)

__all__ = [
    "HYPERPARAMS",
    "EnvCarry",
    "PPOConfig",
    "PPOHyperparams",
    "PPORun",
    "PPOState",
    "annealed_learning_rate",
    "final_return",
    "gae",
    "make_policy",
    "make_ppo_step",
    "make_ppo_train",
    "make_rollout",
    "make_update_epochs",
    "ppo_loss",
    "ppo_optimizer",
    "reset_envs",
]


class PPOConfig(NamedTuple):
    """PureJaxRL's PPO configuration for CartPole (its defaults are these defaults).

    The int fields fix the program's shapes and must be Python ints (``anneal_lr`` a Python
    bool). The float fields may be traced arrays: ``jax.vmap`` over one of them trains one
    agent per value.
    """

    num_envs: int = 4
    num_steps: int = 128
    total_timesteps: int = 500_000
    update_epochs: int = 4
    num_minibatches: int = 4
    hidden: int = 64
    learning_rate: float | jax.Array = 2.5e-4
    anneal_lr: bool = True
    gamma: float | jax.Array = 0.99
    gae_lambda: float | jax.Array = 0.95
    clip_eps: float | jax.Array = 0.2
    ent_coef: float | jax.Array = 0.01
    vf_coef: float | jax.Array = 0.5
    max_grad_norm: float | jax.Array = 0.5

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
    # PureJaxRL unrolls this scan 16 times; on the CPU that only lengthens the compile
    # without speeding up the 128 tiny steps (docs/performance.md).
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


#: The int fields of :class:`PPOConfig`: the sizes the program is built with.
_SIZES = tuple(name for name, kind in typing.get_type_hints(PPOConfig).items() if kind is int)


def _check_config(config: PPOConfig) -> PPOConfig:
    """Raises ValueError on sizes the program can't be built with; returns ``config``."""
    for name in _SIZES:
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


#: The float fields of :class:`PPOConfig` (those that may be traced), in its order: what a
#: PPO step reads from its ``opt_state`` (so a ``Population(..., hyperparams={"ent_coef":
#: [...]})`` gives each member its own value).
HYPERPARAMS = tuple(
    name for name, kind in typing.get_type_hints(PPOConfig).items() if kind == float | jax.Array
)


class PPOHyperparams(NamedTuple):
    """PPO's float hyperparameters, carried in the step's ``opt_state`` as scalar arrays.

    The shape ``optax.inject_hyperparams`` gives its states (a NamedTuple with a
    ``hyperparams`` dict), so :func:`nnxscan.pure.with_hyperparams` and a
    ``Population(hyperparams=...)`` set them per member like an injected learning rate.
    """

    hyperparams: dict[str, jax.Array]


class PPOState(NamedTuple):
    """The ``opt_state`` of :func:`make_ppo_step`: everything one PPO run carries besides
    the policy's weights.

    Fields:
      tx: the optax state of :func:`ppo_optimizer`.
      envs: the ``num_envs`` environments between rollouts (:class:`EnvCarry`).
      key: the run's RNG key, split once per update (rollout and minibatch orders).
      coefficients: the float hyperparameters (:class:`PPOHyperparams`).
    """

    tx: Any
    envs: EnvCarry
    key: jax.Array
    coefficients: PPOHyperparams


def make_ppo_step(env: Any, env_params: Any, config: PPOConfig | None = None) -> Step:
    """PPO as a :class:`~nnxscan.pure.Step` whose ``update`` is ONE PPO iteration: a
    rollout of the ``num_envs`` environments (:func:`make_rollout`), :func:`gae`, and the
    update epochs (:func:`make_update_epochs`). The batch is ``None``: the environments live
    in the ``opt_state`` (:class:`PPOState`), with the optax state, the RNG key and the
    float hyperparameters.

    ``init(graphdef, state)`` reads the policy's :class:`~nnxscan.shell.demos.ppo_policy.RunKey`
    (drawn by :func:`make_policy` from the ``nnx.Rngs`` the policy was built with, after its
    weights), splits it into the environments' reset key and the run's key, resets the
    environments and initializes :func:`ppo_optimizer`. So a policy built from
    ``nnx.Rngs(seed)`` is one seed's whole run, alone (``Trainer``) or as a member of a
    ``Population`` with that seed.

    ``update`` reports ``(loss, aux)``: the loss averaged over the update's minibatches, and
    ``aux`` = ``episode_return`` (the mean over the rollout of each environment's last
    finished episode's return, PureJaxRL's logged ``returned_episode_returns``),
    ``actor_loss``, ``value_loss``, ``entropy`` (averaged like the loss).

    Run ``config.num_updates`` updates: the annealed learning rate reaches zero there (and
    would turn negative after).

    Example:
      >>> step = make_ppo_step(env, env_params, PPOConfig())
      >>> trainer = Trainer(make_policy(env, env_params, config, nnx.Rngs(0)), train_step=step)
      >>> trainer.fit(None, epochs=61, steps_per_epoch=16)   # 976 updates
    """
    config = _check_config(PPOConfig() if config is None else config)
    buffer_size = config.num_envs * config.num_steps
    rollout = make_rollout(env, env_params, config)

    def configured(opt_state: PPOState) -> PPOConfig:
        # The float fields come from the opt_state (a member's own values in a population).
        return config._replace(**opt_state.coefficients.hyperparams)

    def init(graphdef: nnx.GraphDef, state: nnx.State) -> PPOState:
        return start(_run_key(state), state)

    # One compiled program: the shell calls init eagerly, where the resets' and optax's
    # small ops would each be dispatched (and compiled) alone (inside a traced train it is
    # inlined).
    @jax.jit
    def start(run_key: jax.Array, state: nnx.State) -> PPOState:
        reset_key, key = jax.random.split(run_key)
        coefficients = PPOHyperparams(
            {name: jnp.asarray(getattr(config, name), jnp.float32) for name in HYPERPARAMS}
        )
        tx = ppo_optimizer(config)
        return PPOState(
            tx=init_opt_state(tx, state),
            envs=reset_envs(env, env_params, config, reset_key),
            key=key,
            coefficients=coefficients,
        )

    def update(graphdef: nnx.GraphDef, state: nnx.State, opt_state: PPOState, batch: Any = None):
        run_config = configured(opt_state)
        update_epochs = make_update_epochs(graphdef, ppo_optimizer(run_config), run_config)
        key, rollout_key, epochs_key = jax.random.split(opt_state.key, 3)
        policy = nnx.merge(graphdef, state)
        envs, traj = rollout(policy, opt_state.envs, rollout_key)
        _, last_value = policy(envs.obs)
        advantage, target = gae(
            traj.reward, traj.value, traj.done, last_value,
            run_config.gamma, run_config.gae_lambda,
        )  # fmt: skip
        buffer = {
            "obs": traj.obs, "action": traj.action, "log_prob": traj.log_prob,
            "value": traj.value, "advantage": advantage, "target": target,
        }  # fmt: skip
        buffer = jax.tree.map(lambda x: x.reshape(buffer_size, *x.shape[2:]), buffer)
        state, tx_state, (loss, aux) = update_epochs(state, opt_state.tx, buffer, epochs_key)
        aux = {"episode_return": traj.episode_return.mean()} | {
            name: value.mean() for name, value in aux.items()
        }
        new_opt_state = PPOState(tx_state, envs, key, opt_state.coefficients)
        return state, new_opt_state, (loss.mean(), aux)

    return Step(init, update, has_aux=True)


def _run_key(state: nnx.State) -> jax.Array:
    """The policy's one :class:`RunKey` in its ``state``: the key its run starts from."""
    keys = jax.tree.leaves(nnx.filter_state(state, RunKey))
    if len(keys) != 1:
        raise ValueError(
            f"a PPO step reads the key its run starts from in the policy: one RunKey "
            f"variable, found {len(keys)}. Build the policy with make_policy(env, "
            f"env_params, config, nnx.Rngs(seed)) (ActorCritic holds run_key = "
            f"RunKey(rngs.run())), or give your own module such a variable."
        )
    return keys[0]


def make_ppo_train(
    env: Any, env_params: Any, config: PPOConfig | None = None
) -> Callable[[jax.Array], PPORun]:
    """Builds ``train(key) -> PPORun``: a whole PPO run, pure, for one seed.

    ``train`` builds the policy from ``nnx.Rngs(key)`` (:func:`make_policy`), then runs
    :func:`make_ppo_step`'s ``init`` and ``num_updates`` of its ``update`` in a
    ``lax.scan``: the same step ``Trainer(policy, train_step=step).fit(None, ...)`` runs, in
    one program (for a policy built from ``nnx.Rngs(key)`` the same run).

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

    def train(key: jax.Array) -> PPORun:
        # Built inside: a traced float field (a vmapped learning rate) enters the step.
        step = make_ppo_step(env, env_params, config)
        graphdef, state = nnx.split(make_policy(env, env_params, config, nnx.Rngs(key)))
        opt_state = step.init(graphdef, state)

        def one_update(carry, _):
            state, opt_state, (loss, aux) = step.update(graphdef, *carry, None)
            return (state, opt_state), {"loss": loss, **aux}

        (state, _), metrics = jax.lax.scan(
            one_update, (state, opt_state), None, length=config.num_updates
        )
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
