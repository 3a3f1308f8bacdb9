"""PPO (``nnxscan demo ppo``'s algorithm) against its references: CartPole solved within
PureJaxRL's budget, vmapped seeds equal to single-seed runs, the update epochs equal to a
hand-written PureJaxRL-style minibatch loop, GAE and the categorical against closed forms."""

from __future__ import annotations

import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import make_train_step
from nnxscan.shell.demos.ppo import (
    PPOConfig,
    annealed_learning_rate,
    final_return,
    gae,
    make_policy,
    make_ppo_train,
    make_update_epochs,
    ppo_loss,
    ppo_optimizer,
)
from nnxscan.shell.demos.ppo_policy import (
    ActorCritic,
    action_entropy,
    action_log_prob,
    orthogonal,
    sample_action,
)

from conftest import ACROSS_PROGRAMS, tolerance

ENV, ENV_PARAMS = gymnax.make("CartPole-v1")
SHORT = PPOConfig(total_timesteps=4 * 128 * 6)  # 6 updates: a few seconds to compile and run


@pytest.fixture(scope="module")
def trained():
    """Seed 0 trained with PureJaxRL's defaults (5e5 steps): the one long run, shared."""
    return jax.jit(make_ppo_train(ENV, ENV_PARAMS))(jax.random.key(0))


@pytest.mark.slow
def test_seed_0_solves_cartpole_within_half_a_million_steps(trained):
    """Properties, not one machine's digits: XLA picks float kernels per CPU model, and
    PPO's 976 updates amplify the last bits into another trajectory (the final return is
    500.0 on CI's CPU; the demo's vmapped seed 0 ends at 493.5 there, 436.5 on an AMD
    EPYC). Any run of it solves CartPole on the way (a mean over 10 updates of 475 or
    more, gym's threshold) and ends far above where it started."""
    config = PPOConfig()
    returns = np.asarray(trained.metrics["episode_return"])
    assert returns.shape == (config.num_updates,)
    assert config.env_steps()[-1] <= 500_000
    windows = np.convolve(returns, np.ones(10) / 10, mode="valid")
    assert windows.max() >= 475, windows.max()
    assert final_return(returns) >= 400, returns[-10:]
    assert returns[:10].mean() < 100  # it learned: the first updates return far less


def _greedy_episode_returns(policy: ActorCritic, num_envs: int = 8) -> np.ndarray:
    """Returns of one full-length episode per environment, acting greedily with the LIVE
    module (passed to ``nnx.jit``, as a user would call it)."""

    @nnx.jit
    def episodes(policy):
        keys = jax.random.split(jax.random.key(123), num_envs)
        obs, state = jax.vmap(ENV.reset, in_axes=(0, None))(keys, ENV_PARAMS)

        def step(carry, key):
            obs, state, total, alive = carry
            action = jnp.argmax(policy(obs)[0], axis=-1)
            keys = jax.random.split(key, num_envs)
            obs, state, reward, terminated, truncated, _ = jax.vmap(
                ENV.step, in_axes=(0, 0, 0, None)
            )(keys, state, action, ENV_PARAMS)
            total = total + jnp.where(alive, reward, 0.0)
            return (obs, state, total, alive & ~(terminated | truncated)), None

        start = (obs, state, jnp.zeros(num_envs), jnp.ones(num_envs, bool))
        keys = jax.random.split(jax.random.key(7), ENV_PARAMS.max_steps_in_episode)
        return jax.lax.scan(step, start, keys)[0][2]

    return np.asarray(episodes(policy))


@pytest.mark.slow
def test_the_trained_weights_written_back_make_a_working_nnx_module(trained):
    policy = make_policy(ENV, ENV_PARAMS, PPOConfig(), nnx.Rngs(7))
    assert _greedy_episode_returns(policy).mean() < 100  # untrained: the pole falls
    nnx.update(policy, trained.state)
    assert isinstance(policy, nnx.Module)
    kernel = policy.actor.layers[0].kernel[...]
    assert np.array_equal(kernel, trained.state["actor"]["layers"][0]["kernel"][...])
    # Far above the untrained policy; not one CPU's exact returns (see the test above).
    assert _greedy_episode_returns(policy).mean() >= 400


@pytest.mark.slow
def test_four_vmapped_seeds_each_equal_their_single_seed_run():
    train = make_ppo_train(ENV, ENV_PARAMS, SHORT)
    keys = jnp.stack([jax.random.key(s) for s in range(4)])
    together = jax.jit(jax.vmap(train))(keys)
    single = jax.jit(train)
    for i in range(4):
        alone = single(keys[i])
        for got, want in zip(
            jax.tree.leaves(nnx.filter_state(together.state, nnx.Param)),
            jax.tree.leaves(nnx.filter_state(alone.state, nnx.Param)),
            strict=True,
        ):
            np.testing.assert_allclose(np.asarray(got)[i], np.asarray(want), rtol=0, atol=1e-5)
        for name, want in alone.metrics.items():
            got = np.asarray(together.metrics[name])[i]
            np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-6, err_msg=name)
    # Different seeds train different agents (the seeds axis is not broadcast).
    assert not np.allclose(together.metrics["loss"][0], together.metrics["loss"][1])


# -- the update phase against a hand-written PureJaxRL-style loop --------------------------


def _reference_forward(p, obs):
    def tower(layers):
        h = jnp.tanh(obs @ layers[0]["kernel"] + layers[0]["bias"])
        h = jnp.tanh(h @ layers[2]["kernel"] + layers[2]["bias"])
        return h @ layers[4]["kernel"] + layers[4]["bias"]

    return tower(p["actor"]["layers"]), tower(p["critic"]["layers"])[:, 0]


def _reference_loss(p, mb, clip_eps=0.2, vf_coef=0.5, ent_coef=0.01):
    """PureJaxRL's ``_loss_fn``, written out on raw weight arrays."""
    logits, value = _reference_forward(p, mb["obs"])
    logp_all = logits - jax.scipy.special.logsumexp(logits, axis=-1, keepdims=True)
    log_prob = logp_all[jnp.arange(logits.shape[0]), mb["action"]]
    clipped = mb["value"] + jnp.clip(value - mb["value"], -clip_eps, clip_eps)
    value_loss = 0.5 * jnp.maximum((value - mb["target"]) ** 2, (clipped - mb["target"]) ** 2)
    ratio = jnp.exp(log_prob - mb["log_prob"])
    gae_ = (mb["advantage"] - mb["advantage"].mean()) / (mb["advantage"].std() + 1e-8)
    actor = -jnp.minimum(ratio * gae_, jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps) * gae_)
    entropy = -jnp.sum(jax.nn.softmax(logits) * logp_all, axis=-1)
    return actor.mean() + vf_coef * value_loss.mean() - ent_coef * entropy.mean()


def _bits(x: jax.Array) -> np.ndarray:
    """An array as numpy; a typed key (the policy's ``run_key``) as its key data."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _random_buffer(n: int, seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {
        "obs": jnp.asarray(rng.normal(size=(n, 4)), jnp.float32),
        "action": jnp.asarray(rng.integers(0, 2, n), jnp.int32),
        "log_prob": jnp.asarray(np.log(rng.uniform(0.3, 0.7, n)), jnp.float32),
        "value": jnp.asarray(rng.normal(size=n), jnp.float32),
        "advantage": jnp.asarray(rng.normal(size=n), jnp.float32),
        "target": jnp.asarray(rng.normal(size=n), jnp.float32),
    }


@pytest.mark.slow
def test_update_epochs_equal_purejaxrl_style_shuffled_minibatch_loop():
    config = PPOConfig(num_envs=2, num_steps=32, update_epochs=3, num_minibatches=4)
    model = ActorCritic(4, 2, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-3, eps=1e-5))
    buffer, key = _random_buffer(64), jax.random.key(5)

    update = jax.jit(make_update_epochs(graphdef, tx, config))
    new_state, _, (losses, aux) = update(state, tx.init(nnx.state(model, nnx.Param)), buffer, key)
    assert losses.shape == (3, 4) and aux["entropy"].shape == (3, 4)

    # The reference: a permutation per epoch, reshaped into minibatches, one optax step each.
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    opt_state = tx.init(params)
    value_and_grad, tx_update = jax.jit(jax.value_and_grad(_reference_loss)), jax.jit(tx.update)
    want_losses = []
    for epoch_key in jax.random.split(key, 3):
        order = jax.random.permutation(epoch_key, 64)
        for mb_index in np.asarray(order).reshape(4, 16):
            mb = jax.tree.map(lambda x, i=mb_index: x[i], buffer)
            loss, grads = value_and_grad(params, mb)
            updates, opt_state = tx_update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            want_losses.append(float(loss))
    np.testing.assert_allclose(np.asarray(losses).ravel(), want_losses, rtol=1e-5, atol=1e-6)
    got = nnx.to_pure_dict(nnx.filter_state(new_state, nnx.Param))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("vmapped", [False, True])
def test_update_epochs_batch_as_purejaxrl_permute_reshape_and_scan(vmapped):
    """The update epochs' minibatches are PureJaxRL's: per epoch ``jax.random.permutation``
    of the buffer, ``jnp.take`` of the shuffled copy, reshaped into ``num_minibatches`` and
    ``lax.scan``-ned, with the same step: the same losses, aux, params and optimizer state
    (to rounding: the two updates are two programs, see conftest's ACROSS_PROGRAMS; a
    minibatch drawn otherwise would be far off), for one seed and vmapped over two (as the
    demo runs its seeds). The update gathers each epoch's minibatches once, before its
    loop, as PureJaxRL does (``scan_indexed_steps``)."""
    config = PPOConfig(num_envs=2, num_steps=16, update_epochs=2, num_minibatches=4)
    n, minibatches = config.num_envs * config.num_steps, config.num_minibatches
    graphdef, state = nnx.split(ActorCritic(4, 2, rngs=nnx.Rngs(0)))
    tx = optax.sgd(0.05, momentum=0.9)  # any optimizer: the minibatches are what's checked
    opt_state = tx.init(nnx.state(nnx.merge(graphdef, state), nnx.Param))
    step = make_train_step(
        lambda model, batch: ppo_loss(model, batch, clip_eps=0.2, vf_coef=0.5, ent_coef=0.01),
        tx,
        has_aux=True,
    )

    def purejaxrl_update(state, opt_state, buffer, key):  # their _update_epoch, written out
        def update_epoch(carry, epoch_key):
            permutation = jax.random.permutation(epoch_key, n)
            shuffled = jax.tree.map(lambda x: jnp.take(x, permutation, axis=0), buffer)
            batches = jax.tree.map(lambda x: x.reshape(minibatches, -1, *x.shape[1:]), shuffled)

            def update_minibatch(carry, batch):
                state, opt_state, out = step(graphdef, *carry, batch)
                return (state, opt_state), out

            return jax.lax.scan(update_minibatch, carry, batches)

        keys = jax.random.split(key, config.update_epochs)
        (state, opt_state), out = jax.lax.scan(update_epoch, (state, opt_state), keys)
        return state, opt_state, out

    ours = make_update_epochs(graphdef, tx, config)
    buffers = [_random_buffer(n, seed) for seed in (0, 1)]
    keys = jax.random.split(jax.random.key(5), 2)
    one = (state, opt_state, buffers[0], keys[0])
    both = (
        *jax.tree.map(lambda x: jnp.stack([x, x]), (state, opt_state)),
        jax.tree.map(lambda *x: jnp.stack(x), *buffers),
        keys,
    )
    program, args = (lambda f: jax.jit(jax.vmap(f)), both) if vmapped else (jax.jit, one)
    got, want = program(ours)(*args), program(purejaxrl_update)(*args)
    assert got[2][0].shape[-2:] == (config.update_epochs, minibatches)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = _bits(g), _bits(w)
        if np.issubdtype(g.dtype, np.inexact):
            np.testing.assert_allclose(g, w, **ACROSS_PROGRAMS)
        else:  # keys and counts
            np.testing.assert_array_equal(g, w)
    if vmapped:  # the seeds' runs differ (the vmapped axis is not broadcast)
        assert not np.array_equal(np.asarray(got[2][0][0]), np.asarray(got[2][0][1]))


# -- pieces against closed forms -------------------------------------------------------------


def test_gae_equals_the_backward_recursion_written_as_a_python_loop():
    rng = np.random.default_rng(0)
    steps, envs, gamma, lam = 37, 3, 0.99, 0.95
    rewards, values = rng.normal(size=(steps, envs)), rng.normal(size=(steps, envs))
    dones, last_value = rng.uniform(size=(steps, envs)) < 0.1, rng.normal(size=envs)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    adv, targets = gae(f32(rewards), f32(values), jnp.asarray(dones), f32(last_value), gamma, lam)
    want = np.zeros((steps, envs))
    running, next_value = np.zeros(envs), last_value
    for t in reversed(range(steps)):
        nonterminal = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_value * nonterminal - values[t]
        running = delta + gamma * lam * nonterminal * running
        want[t], next_value = running, values[t]
    np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(targets), want + values, rtol=1e-5, atol=1e-5)


def test_categorical_log_prob_entropy_and_sampling_match_the_softmax():
    logits = jnp.array([[0.0, 0.0], [2.0, -1.0], [-3.0, 1.5]])
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    actions = jnp.array([1, 0, 1])
    np.testing.assert_allclose(
        action_log_prob(logits, actions),
        np.log(probs[np.arange(3), actions]),
        **tolerance(1e-5, 0),
    )
    np.testing.assert_allclose(
        action_entropy(logits), -(probs * np.log(probs)).sum(-1), **tolerance(1e-5, 0)
    )
    assert float(action_entropy(jnp.zeros(2))) == pytest.approx(np.log(2))
    draws = sample_action(jax.random.key(0), jnp.broadcast_to(logits, (20_000, 3, 2)))
    np.testing.assert_allclose(np.asarray(draws).mean(0), probs[:, 1], atol=0.015)


@pytest.mark.parametrize(
    "shape",
    [*(pytest.param(s, marks=pytest.mark.slow) for s in [(4, 64), (64, 64), (64, 2)]), (64, 1)],
)
def test_orthogonal_init_is_nnx_orthogonal_without_lapack(shape):
    key = jax.random.key(3)
    got = np.asarray(orthogonal(1.4)(key, shape))
    np.testing.assert_allclose(got, nnx.initializers.orthogonal(1.4)(key, shape), atol=5e-6)
    small = min(shape)
    gram = got.T @ got if shape[0] >= shape[1] else got @ got.T
    np.testing.assert_allclose(gram, 1.4**2 * np.eye(small), atol=1e-5)
    # No LAPACK call (a custom call on the CPU), unlike nnx's, even when vmapped over seeds.
    keys = jax.random.split(key, 4)

    def lowered(init):
        return jax.jit(jax.vmap(lambda k: init(k, shape))).lower(keys).as_text()

    assert "custom_call" in lowered(nnx.initializers.orthogonal(1.0))
    assert "custom_call" not in lowered(orthogonal(1.0))


def test_learning_rate_anneals_per_update_to_zero_as_purejaxrl():
    config = PPOConfig()
    schedule = annealed_learning_rate(config)
    per_update = config.update_epochs * config.num_minibatches  # 16 optimizer steps
    for update in (0, 1, 500, config.num_updates - 1):
        for count in (update * per_update, update * per_update + per_update - 1):
            want = 2.5e-4 * (1 - update / config.num_updates)
            assert float(schedule(jnp.asarray(count))) == pytest.approx(want, abs=1e-9)
    lr = ppo_optimizer(PPOConfig(anneal_lr=False))
    assert isinstance(lr, optax.GradientTransformation)


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (PPOConfig(num_minibatches=3), "does not\nsplit into num_minibatches=3"),
        (PPOConfig(total_timesteps=100), "less than one rollout"),
        (PPOConfig(num_envs=0), "num_envs must be a positive int"),
        (PPOConfig(num_steps=12.5), "num_steps must be a positive int"),
    ],
)
def test_bad_sizes_are_refused_before_anything_compiles(config, words):
    with pytest.raises(ValueError, match=words.replace("\n", " ")):
        make_ppo_train(ENV, ENV_PARAMS, config)


def test_actor_critic_has_the_weights_nnx_orthogonal_init_gives_the_same_module():
    root2 = float(np.sqrt(2))

    def dense(fan_in, fan_out, scale, rngs):
        return nnx.Linear(fan_in, fan_out, rngs=rngs,
                          kernel_init=nnx.initializers.orthogonal(scale),
                          bias_init=nnx.initializers.zeros_init())  # fmt: skip

    class NnxInit(nnx.Module):  # PureJaxRL's towers with nnx's own (LAPACK) orthogonal init
        def __init__(self, rngs):
            self.actor = nnx.Sequential(dense(4, 64, root2, rngs), nnx.tanh,
                                        dense(64, 64, root2, rngs), nnx.tanh,
                                        dense(64, 2, 0.01, rngs))  # fmt: skip
            self.critic = nnx.Sequential(dense(4, 64, root2, rngs), nnx.tanh,
                                         dense(64, 64, root2, rngs), nnx.tanh,
                                         dense(64, 1, 1.0, rngs))  # fmt: skip

    ours = nnx.to_pure_dict(nnx.state(ActorCritic(4, 2, rngs=nnx.Rngs(5)), nnx.Param))
    want = nnx.to_pure_dict(nnx.state(NnxInit(nnx.Rngs(5))))
    for got, expected in zip(jax.tree.leaves(ours), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, expected, atol=2e-5)


@pytest.mark.parametrize("streams", ["one", "separate"])
def test_the_kernel_keys_and_run_key_are_the_draws_nnx_rngs_gives(streams):
    """ActorCritic's kernel keys and run key are the stream's own draws (each layer a
    kernel key then a bias key, then the run key), and the streams move on as far as those
    draws move them: what makes a population member its seed's run alone."""

    def rngs():
        return nnx.Rngs(3) if streams == "one" else nnx.Rngs(params=3, run=7)

    reference = rngs()
    kernel_keys = []
    for _ in range(6):
        kernel_keys.append(reference.params())
        reference.params()  # the bias's draw
    run_key = reference.run()
    gaussians = [jax.random.normal(k, shape) for k, shape in zip(kernel_keys, [
        (64, 4), (64, 64), (64, 2), (64, 4), (64, 64), (64, 1)], strict=True)]  # fmt: skip

    given = rngs()
    policy = ActorCritic(4, 2, rngs=given)
    np.testing.assert_array_equal(
        jax.random.key_data(policy.run_key[...]), jax.random.key_data(run_key)
    )
    for stream in ("params", "run"):
        assert int(getattr(given, stream).count[...]) == int(getattr(reference, stream).count[...])
    # Each kernel is the orthogonalized Gaussian of its key (Q's columns span the draw's).
    layers = [*policy.actor.layers[::2], *policy.critic.layers[::2]]
    for layer, g in zip(layers, gaussians, strict=True):
        kernel = np.asarray(layer.kernel[...], np.float64)
        tall = kernel if kernel.shape[0] >= kernel.shape[1] else kernel.T
        q, r = np.linalg.qr(np.asarray(g, np.float64))
        q = q * np.sign(np.diagonal(r))
        scale = np.linalg.norm(tall[:, 0])
        np.testing.assert_allclose(tall / scale, q, atol=5e-5)
