"""What the shell costs a user's own step, against what it costs its built-in step.

Small MLP (64 -> 64 -> 64 -> 10, ReLU), batch 32, ``--steps`` steps an epoch (default
2,000), Adam. Three steps, each run two ways on the SAME batches (the order
``epoch_order(0, e, n)`` gives), warm (compiled before timing), interleaved in a shuffled
order each round, in one process; medians of µs/step and the ratio shell ÷ by hand:

  built-in   ``make_train_step(loss_fn, adam)``:
               fit    ``Trainer(model, adam, loss_fn).fit(data, epochs=1)``
               hand   ``jax.jit`` of ``x[order]`` once + ``lax.scan`` of the same step
  user Step  a hand-written Adam step (``jax.value_and_grad`` + ``tx.update``) as a
             ``nnxscan.pure.Step``:
               fit    ``Trainer(model, train_step=S).fit(data, epochs=1)``
               hand   the same by-hand scan of ``S.update``
  NNX fn     the Flax tutorial's stateful ``train_step(model, optimizer, batch)``:
               fit    ``Trainer(model, optimizer, train_step=fn).fit(data, epochs=1)``
               hand   the same by-hand scan of ``nnx_train_step(fn).update``
             and, for reference, Flax's own ``nnx.scan`` over ``nnx.Carry`` in ``nnx.jit``
             on the batches stacked beforehand (the stacking outside the timing)

The issue's bar: a user's step costs no more over its by-hand scan than the built-in step
costs over its own (the last column's ratios alike).

    python benchmarks/bench_custom_step.py --reps 11
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import optax

# The workload of bench_epoch.py (run as a script, its folder is on the path).
from bench_epoch import BATCH, MLP, interleaved_times, loss_fn
from flax import nnx

from nnxscan.pure import Step, epoch_order, init_opt_state, make_train_step, split_wrt
from nnxscan.pure import nnx_train_step as pure_nnx_step
from nnxscan.shell import Trainer

TX = optax.adam(1e-3)


def user_step() -> Step:
    """Adam written by hand on the pure contract, as a user would."""

    def init(graphdef, state):
        return init_opt_state(TX, state)

    def update(graphdef, state, opt_state, batch):
        params, rest = split_wrt(state, nnx.Param)
        loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch))(
            params
        )
        updates, opt_state = TX.update(grads, opt_state, params)
        return nnx.merge_state(optax.apply_updates(params, updates), rest), opt_state, loss

    return Step(init, update)


@nnx.jit
def nnx_train_step(model, optimizer, batch):  # the Flax tutorial's shape
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def variants(steps: int) -> tuple[dict, list]:
    n = steps * BATCH
    rng = np.random.default_rng(0)
    data = {
        "x": jnp.asarray(rng.normal(size=(n, 64)).astype(np.float32)),
        "y": jnp.asarray(rng.integers(0, 10, n).astype(np.int32)),
    }
    epoch_index = [0]

    def order() -> jax.Array:
        return jnp.asarray(epoch_order(0, epoch_index[0], n))

    def stacked() -> dict:
        o = order()
        return jax.tree.map(lambda v: v[o].reshape(steps, BATCH, *v.shape[1:]), data)

    def by_hand(step: Step, objects=lambda: MLP(nnx.Rngs(0))):
        graphdef, state = nnx.split(objects())
        carry = {"c": (state, step.init(graphdef, state))}

        @jax.jit
        def epoch(s, o, data, idx):
            batches = jax.tree.map(lambda v: v[idx].reshape(steps, BATCH, *v.shape[1:]), data)

            def body(c, batch):
                s, o, out = step.update(graphdef, *c, batch)
                return (s, o), out[0] if step.has_aux else out

            (s, o), losses = jax.lax.scan(body, (s, o), batches)
            return s, o, losses

        def run(_):
            s, o, losses = epoch(*carry["c"], data, order())
            carry["c"] = (s, o)
            return losses[-1]

        return run

    def fit(trainer: Trainer):
        return lambda _: trainer.fit(data, epochs=1, batch_size=BATCH, progress=False).losses[-1]

    builtin = make_train_step(loss_fn, TX)
    S = user_step()
    fx_model = MLP(nnx.Rngs(0))
    fx_opt = nnx.Optimizer(fx_model, TX, wrt=nnx.Param)

    @nnx.jit
    def flax_epoch(model, optimizer, batches):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def body(carry, batch):
            model, optimizer = carry
            return (model, optimizer), nnx_train_step(model, optimizer, batch)

        return body((model, optimizer), batches)[1]

    nnx_model = MLP(nnx.Rngs(0))
    none = lambda: None  # noqa: E731

    def model_and_optimizer():
        model = MLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, TX, wrt=nnx.Param)

    return {
        "built-in fit": (fit(Trainer(MLP(nnx.Rngs(0)), TX, loss_fn)), none),
        "built-in hand": (by_hand(builtin), none),
        "user Step fit": (fit(Trainer(MLP(nnx.Rngs(0)), train_step=S)), none),
        "user Step hand": (by_hand(S), none),
        "NNX fn fit": (
            fit(
                Trainer(
                    nnx_model,
                    nnx.Optimizer(nnx_model, TX, wrt=nnx.Param),
                    train_step=nnx_train_step,
                )
            ),
            none,
        ),
        "NNX fn hand": (by_hand(pure_nnx_step(nnx_train_step), model_and_optimizer), none),
        "NNX fn nnx.scan": (lambda b: flax_epoch(fx_model, fx_opt, b)[-1], stacked),
    }, epoch_index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=11)
    args = parser.parse_args()
    runs, epoch_index = variants(args.steps)
    times = interleaved_times(runs, epoch_index, args.steps, args.reps)
    print(f"jax {jax.__version__}, {args.steps} steps an epoch, batch {BATCH}, {args.reps} reps")
    print("| step | fit µs/step | by hand µs/step | fit ÷ by hand |\n|---|---:|---:|---:|")
    for kind, hand in (("built-in", "hand"), ("user Step", "hand"), ("NNX fn", "hand")):
        shell = statistics.median(times[f"{kind} fit"])
        ref = statistics.median(times[f"{kind} {hand}"])
        print(f"| {kind} | {shell:.1f} | {ref:.1f} | {shell / ref:.2f} |")
    flax = statistics.median(times["NNX fn nnx.scan"])
    print(f"\nFlax's nnx.scan of the NNX fn on batches stacked beforehand: {flax:.1f} µs/step")


if __name__ == "__main__":
    main()
