"""An epoch over a data set against the same step on pre-stacked batches (issue: epochs at
the speed of a stacked scan), and against Flax's own ``nnx.scan``.

Small MLP (64 -> 64 -> 64 -> 10, ReLU), batch 32, ``--steps`` steps an epoch (default
2,000), Adam. Every variant trains one epoch of the SAME batches (the order
``epoch_order(0, e, n)`` gives) per timed call, warm (compiled before timing); variants are
interleaved in a shuffled order each round, in one process; medians of µs/step and the ratios
to ``scan_train`` and to ``nnx_scan``:

  scan_train      ``nnxscan.shell.scan_train`` over the epoch's batches already stacked
  fit             ``Trainer.fit(data, epochs=1)`` over the flat data set (a whole fit per
                  epoch: its set-up and its first call's gather are timed)
  fit_4_epochs    ``Trainer.fit(data, epochs=4)``, per step: what a fit of several epochs
                  costs an epoch (one set-up for the four)
  fit_unshuffled  ``Trainer.fit(data[order], epochs=1, shuffle=False)``: the same batches
                  as the stacked variants, from a data set already in the epoch's order
                  (permuted outside the timing, as the stacked variants' batches are): each
                  step slices its batch, nothing is gathered
  fit_unshuffled_4_epochs
                  ``Trainer.fit(data[order], epochs=4, shuffle=False)``, per step: four
                  epochs of those batches in one fit (one set-up), against ``nnx_scan``'s
                  one call per epoch
  make_epoch      ``jax.jit(pure.make_epoch(step))`` with the same order
  hand_gather     by hand: ``x[order]`` once, reshaped to ``(steps, batch, ...)``, ``lax.scan``
  nnx_scan        Flax's ``nnx.scan`` over a stateful step (model and optimizer as
                  ``nnx.Carry``) inside ``nnx.jit``, on stacked batches: the Flax anchor
  nnx_scan_shuffled
                  the same, timing the epoch's shuffle too (``x[order]`` on the device,
                  reshaped): what a Flax user's epoch over a data set costs

    python benchmarks/bench_epoch.py --reps 15
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nnxscan.pure import epoch_order, init_opt_state, make_epoch, make_train_step
from nnxscan.shell import Trainer, scan_train

BATCH = 32
FIT_EPOCHS = 4  # the epochs of the fit_4_epochs variant's one timed fit


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(64, 64, rngs=rngs)
        self.l2 = nnx.Linear(64, 64, rngs=rngs)
        self.l3 = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))


def loss_fn(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def nnx_scan_epoch(loss):
    """Flax's own scanned epoch: ``epoch(model, optimizer, batches) -> losses``, one
    ``nnx.jit`` call of ``nnx.scan`` over stacked batches, model and optimizer carried."""

    @nnx.jit
    def epoch(model, optimizer, batches):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def body(carry, batch):
            model, optimizer = carry
            value, grads = nnx.value_and_grad(loss)(model, batch)
            optimizer.update(model, grads)
            return (model, optimizer), value

        return body((model, optimizer), batches)[1]

    return epoch


def variants(steps: int) -> dict:
    n = steps * BATCH
    rng = np.random.default_rng(0)
    data = {
        "x": jnp.asarray(rng.normal(size=(n, 64)).astype(np.float32)),
        "y": jnp.asarray(rng.integers(0, 10, n).astype(np.int32)),
    }
    tx = optax.adam(1e-3)
    epoch_index = [0]

    def order() -> np.ndarray:
        return epoch_order(0, epoch_index[0], n)

    def stacked() -> dict:
        o = jnp.asarray(order())
        return jax.tree.map(lambda v: v[o].reshape(steps, BATCH, *v.shape[1:]), data)

    # scan_train on stacked batches (the stacking is outside the timing).
    st_model = MLP(nnx.Rngs(0))
    st_opt = nnx.Optimizer(st_model, tx, wrt=nnx.Param)

    def run_scan_train(batches):
        return scan_train(st_model, st_opt, loss_fn, batches)[-1]

    trainer = Trainer(MLP(nnx.Rngs(0)), tx, loss_fn)

    def run_fit(_):
        return trainer.fit(data, epochs=1, batch_size=BATCH, progress=False).losses[-1]

    trainer4 = Trainer(MLP(nnx.Rngs(0)), tx, loss_fn)

    def run_fit4(_):
        return trainer4.fit(data, epochs=FIT_EPOCHS, batch_size=BATCH, progress=False).losses[-1]

    trainer_u = Trainer(MLP(nnx.Rngs(0)), tx, loss_fn)

    def permuted() -> dict:
        o = jnp.asarray(order())
        return jax.tree.map(lambda v: v[o], data)

    def run_fit_unshuffled(flat):
        history = trainer_u.fit(flat, epochs=1, batch_size=BATCH, shuffle=False, progress=False)
        return history.losses[-1]

    trainer_u4 = Trainer(MLP(nnx.Rngs(0)), tx, loss_fn)

    def run_fit_unshuffled4(flat):
        history = trainer_u4.fit(
            flat, epochs=FIT_EPOCHS, batch_size=BATCH, shuffle=False, progress=False
        )
        return history.losses[-1]

    step = make_train_step(loss_fn, tx)
    graphdef, state = nnx.split(MLP(nnx.Rngs(0)))
    pure = {"carry": (state, init_opt_state(tx, state))}
    epoch = jax.jit(make_epoch(step, batch_size=BATCH), donate_argnums=(1, 2))

    def run_make_epoch(_):
        s, o, losses = epoch(graphdef, *pure["carry"], data, jnp.asarray(order()))
        pure["carry"] = (s, o)
        return losses[-1]

    _, state2 = nnx.split(MLP(nnx.Rngs(0)))  # its own buffers: make_epoch donates
    hand = {"carry": (state2, init_opt_state(tx, state2))}

    @jax.jit
    def hand_epoch(s, o, data, idx):
        batches = jax.tree.map(lambda v: v[idx].reshape(steps, BATCH, *v.shape[1:]), data)

        def body(carry, batch):
            s, o, loss = step(graphdef, *carry, batch)
            return (s, o), loss

        (s, o), losses = jax.lax.scan(body, (s, o), batches)
        return s, o, losses

    def run_hand(_):
        s, o, losses = hand_epoch(*hand["carry"], data, jnp.asarray(order()))
        hand["carry"] = (s, o)
        return losses[-1]

    fx_model = MLP(nnx.Rngs(0))
    fx_opt = nnx.Optimizer(fx_model, tx, wrt=nnx.Param)

    flax_epoch = nnx_scan_epoch(loss_fn)

    def run_nnx_scan(batches):
        return flax_epoch(fx_model, fx_opt, batches)[-1]

    fs_model = MLP(nnx.Rngs(0))
    fs_opt = nnx.Optimizer(fs_model, tx, wrt=nnx.Param)

    def run_nnx_scan_shuffled(_):
        # What a Flax user's epoch does: shuffle on the device, then nnx.scan.
        return flax_epoch(fs_model, fs_opt, stacked())[-1]

    return {
        "scan_train": (run_scan_train, stacked),
        "fit": (run_fit, lambda: None),
        "fit_4_epochs": (run_fit4, lambda: None),
        "fit_unshuffled": (run_fit_unshuffled, permuted),
        "fit_unshuffled_4_epochs": (run_fit_unshuffled4, permuted),
        "make_epoch": (run_make_epoch, lambda: None),
        "hand_gather": (run_hand, lambda: None),
        "nnx_scan": (run_nnx_scan, stacked),
        "nnx_scan_shuffled": (run_nnx_scan_shuffled, lambda: None),
    }, epoch_index


def interleaved_times(runs: dict, epoch_index: list, steps: int, reps: int) -> dict:
    """µs/step of each ``name: (fn, prepare)`` over ``reps`` rounds, compiled first, in a new
    shuffled order each round (round ``r`` trains epoch ``r + 1``'s order)."""
    for fn, prepare in runs.values():  # compile
        jax.block_until_ready(fn(prepare()))
    times: dict[str, list[float]] = {name: [] for name in runs}
    shuffler = random.Random(0)
    for rep in range(reps):
        epoch_index[0] = rep + 1
        names = list(runs)
        shuffler.shuffle(names)
        for name in names:
            fn, prepare = runs[name]
            arg = jax.block_until_ready(prepare())
            t0 = time.perf_counter()
            jax.block_until_ready(fn(arg))
            epochs = FIT_EPOCHS if name.endswith("_4_epochs") else 1
            times[name].append((time.perf_counter() - t0) / (epochs * steps) * 1e6)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=11)
    args = parser.parse_args()
    runs, epoch_index = variants(args.steps)
    times = interleaved_times(runs, epoch_index, args.steps, args.reps)
    base = statistics.median(times["scan_train"])
    anchor = statistics.median(times["nnx_scan"])
    print(f"jax {jax.__version__}, {args.steps} steps an epoch, batch {BATCH}, {args.reps} reps")
    print("| variant | µs/step (median) | ÷ scan_train | ÷ nnx_scan |\n|---|---:|---:|---:|")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.1f} | {med / base:.3f} | {med / anchor:.3f} |")


if __name__ == "__main__":
    main()
