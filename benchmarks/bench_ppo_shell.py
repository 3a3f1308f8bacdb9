"""PPO's whole run through the shell against the single-``jit`` run, compile included.

The same PPO (``nnxscan.shell.demos.ppo``, PureJaxRL's CartPole defaults, one seed) three
ways, each in a fresh process (cold compilation caches, no persistent cache), timed from
building the policy to the trained result:

  jit          ``jax.jit(make_ppo_train(...)).lower(key).compile()`` then the call: one program
               (``nnxscan demo ppo``);
  shell        ``Trainer(policy, train_step=make_ppo_step(...)).fit(None, epochs=61,
               steps_per_epoch=16, checkpoint_dir=D, checkpoint_every=8, resume=True)``:
               61 calls, a checkpoint every 128 updates and at the end, as
               ``nnxscan demo ppo --checkpoint-dir D`` saves;
  shell-every-epoch  the same with a checkpoint after every call (``checkpoint_every=1``);
  shell-nockpt the same fit without checkpoints.

Rounds run every variant once in a new shuffled order; medians, and the median of each
round's shell ÷ jit ratio, of the wall time and of the CPU time (the process's, all its
threads: on a machine other jobs share, the wall time also counts the waits for a core,
the CPU time mostly the work).

    python benchmarks/bench_ppo_shell.py --rounds 5
    python benchmarks/bench_ppo_shell.py --quick      # 32 updates, 1 round: it runs
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("jit", "shell", "shell-every-epoch", "shell-nockpt")


def child(variant: str, updates: int) -> None:
    import gymnax
    import jax
    from flax import nnx

    from nnxscan.shell import Trainer
    from nnxscan.shell.demos.ppo import PPOConfig, make_policy, make_ppo_step, make_ppo_train
    from nnxscan.shell.demos.ppo_demo import checkpoint_epochs

    jax.numpy.zeros(()).block_until_ready()  # the backend starts before the clock
    env, env_params = gymnax.make("CartPole-v1")
    config = PPOConfig(total_timesteps=updates * 4 * 128)
    start, cpu_start = time.perf_counter(), time.process_time()
    if variant == "jit":
        key = jax.random.key(0)
        compiled = jax.jit(make_ppo_train(env, env_params, config)).lower(key).compile()
        run = jax.block_until_ready(compiled(key))
        final = float(run.metrics["episode_return"][-16:].mean())
    else:
        trainer = Trainer(
            make_policy(env, env_params, config, nnx.Rngs(0)),
            train_step=make_ppo_step(env, env_params, config),
        )
        options = {}
        if variant != "shell-nockpt":
            every = 1 if variant == "shell-every-epoch" else checkpoint_epochs(16)
            options = {"checkpoint_dir": tempfile.mkdtemp(), "resume": True,
                       "checkpoint_every": every}  # fmt: skip
        history = trainer.fit(
            None, epochs=updates // 16, steps_per_epoch=16, progress=False, **options
        )
        final = float(history.epochs[-1]["episode_return"])
    whole, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    print(json.dumps({"whole": whole, "cpu": cpu, "return": final}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "UPDATES"))
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    updates, rounds = (32, 1) if args.quick else (976, args.rounds)
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = list(VARIANTS)
        random.Random(r).shuffle(order)
        for variant in order:
            out = subprocess.run(
                [sys.executable, __file__, "--child", variant, str(updates)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            result = json.loads(out.stdout.strip().splitlines()[-1])
            results[variant].append(result)
            print(f"round {r}: {variant:>17} whole {result['whole']:6.2f} s, "
                  f"cpu {result['cpu']:6.2f} s, return {result['return']:6.1f}",
                  flush=True)  # fmt: skip
    print(f"\nPPO CartPole-v1, {updates} updates, one seed; medians of {rounds} round(s)\n")
    print("| variant | whole run (s) | ÷ jit (paired) | CPU time (s) | ÷ jit (paired) |")
    print("|---|---:|---:|---:|---:|")
    for variant in VARIANTS:
        cells = []
        for what in ("whole", "cpu"):
            median = statistics.median(r[what] for r in results[variant])
            paired = statistics.median(
                a[what] / b[what] for a, b in zip(results[variant], results["jit"], strict=True)
            )
            cells += [f"{median:.2f}", f"{paired:.2f}×"]
        print(f"| {variant} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
