"""Run by tests/test_ppo_shell.py in subprocesses (not collected by pytest).

``python ppo_resume_worker.py CHECKPOINT_DIR OUT.npz CACHE_DIR``: a tiny PPO run through
``Trainer(policy, train_step=make_ppo_step(...)).fit(None, ..., resume=True)`` with a
checkpoint after every call: rerunning the same command after a kill goes on from the
newest checkpoint. It prints "ready" before ``fit`` and "step N" after every compiled
call; once the run is complete it writes the policy's weights and run key, every leaf of
the step's opt_state (optax state, environment states, the run's key) and the per-step
losses to OUT.npz, and prints "done".
"""

from __future__ import annotations

import sys

EPOCHS, STEPS_PER_EPOCH, SEED = 4, 6, 2
# Each call takes at least this long, as a real run's would: the test's kill, up to 20 ms
# after a call's report, then lands before the run ends. Timing changes nothing trained.
PACE_S = 0.03
CONFIG = dict(num_envs=2, num_steps=16, update_epochs=2, num_minibatches=2, hidden=8)


def config():
    from nnxscan.shell.demos.ppo import PPOConfig

    return PPOConfig(total_timesteps=2 * 16 * EPOCHS * STEPS_PER_EPOCH, **CONFIG)


def leaves_as_arrays(tree) -> list:
    """Every leaf as numpy; typed keys as their key data (bitwise comparable)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    out = []
    for leaf in jax.tree.leaves(tree):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out.append(np.asarray(leaf))
    return out


def main(checkpoint_dir: str, out: str, cache_dir: str) -> None:
    import time

    import gymnax
    import numpy as np
    from flax import nnx

    from nnxscan.shell import LambdaCallback, Trainer, enable_compilation_cache
    from nnxscan.shell.demos.ppo import make_policy, make_ppo_step

    enable_compilation_cache(cache_dir)
    env, env_params = gymnax.make("CartPole-v1")
    trainer = Trainer(
        make_policy(env, env_params, config(), nnx.Rngs(SEED)),
        train_step=make_ppo_step(env, env_params, config()),
    )

    def report(t, logs):
        print(f"step {t.step}", flush=True)
        time.sleep(PACE_S)

    print("ready", flush=True)
    history = trainer.fit(
        None, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH, steps_per_call=1,
        checkpoint_dir=checkpoint_dir, checkpoint_every_steps=1, resume=True,
        progress=False, callbacks=[LambdaCallback(on_call_end=report)],
    )  # fmt: skip
    arrays = leaves_as_arrays((nnx.state(trainer.model), trainer.opt_state))
    np.savez(out, *arrays, losses=history.losses)
    print("done", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__file__))
    main(*sys.argv[1:4])
