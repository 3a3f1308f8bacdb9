"""What the shared-buffer check before a donating call costs.

Before a compiled call that would donate arrays the user's objects hold (the first call of
a run, and each call after a write-back), the shell compares each carry leaf's reference
count with the one reference its owner keeps, and copies a leaf something else holds
(``nnx.clone(model)`` shares arrays). This measures that check per call, for

- ``digits``: the MLP 64->128->128->10 of ``nnxscan demo`` with Adam (19 carry leaves);
- ``deep``: an MLP of 16 Linear layers of width 32 with Adam (97 carry leaves);

as ``LiveState.donatable()`` with the check (the leaves were exposed) and without it (what
every call did before: only the repeated-object check), paired and interleaved, medians in
microseconds; and, for scale, one epoch of ``Trainer.fit`` (44 steps of 32 on 1,408 digits-
shaped examples, an epoch callback so that every epoch is one call and checked) with the
check and with it patched out.

    python benchmarks/bench_donation_check.py --rounds 7
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import numpy as np
import optax
from flax import nnx

from nnxscan.shell import LambdaCallback, Trainer
from nnxscan.shell._engine import calls as _calls
from nnxscan.shell._engine.owner import ModelOwner
from nnxscan.shell._engine.placement import Placement


class MLP(nnx.Module):
    def __init__(self, sizes: list[int], rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


MODELS = {"digits": [64, 128, 128, 10], "deep": [64] + [32] * 15 + [10]}


def check_cost(sizes: list[int], rounds: int, reps: int) -> tuple[int, float, float]:
    """``(leaves, µs with the check, µs without)`` of ``donatable()``, medians of rounds."""
    model = MLP(sizes, nnx.Rngs(0))
    owner = ModelOwner(model, optax.adam(1e-3))
    live = _calls.LiveState(*owner.read()[1:], owner.make_write_back(), Placement())
    live.donatable()  # the first check, on the owner's originals
    with_check, without = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            live._exposed = True  # as after a write-back: the next call checks
            live.donatable()
        with_check.append((time.perf_counter() - start) / reps * 1e6)
        start = time.perf_counter()
        for _ in range(reps):
            live._exposed = False  # a call's fresh outputs: no check
            live.donatable()
        without.append((time.perf_counter() - start) / reps * 1e6)
    return len(live.leaves), statistics.median(with_check), statistics.median(without)


def epoch_cost(rounds: int, epochs: int) -> tuple[float, float]:
    """ms per epoch of fit with the check and without it (patched out), interleaved."""
    rng = np.random.default_rng(0)
    data = {
        "x": rng.normal(size=(1408, 64)).astype(np.float32),
        "y": rng.integers(0, 10, size=1408).astype(np.int32),
    }
    tx = optax.adam(1e-3)

    def loss_fn(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    checked = _calls.LiveState.donatable

    def unchecked(self):
        self._exposed = False
        return _calls._unaliased(self.leaves)

    def run() -> float:
        trainer = Trainer(MLP(MODELS["digits"], nnx.Rngs(0)), tx, loss_fn)
        callback = LambdaCallback(on_epoch_end=lambda *a: None)  # one call per epoch
        trainer.fit(data, epochs=1, batch_size=32, progress=False, callbacks=[callback])
        start = time.perf_counter()
        trainer.fit(data, epochs=epochs, batch_size=32, progress=False, callbacks=[callback])
        return (time.perf_counter() - start) / epochs * 1e3

    on, off = [], []
    try:
        for _ in range(rounds):
            _calls.LiveState.donatable = checked
            on.append(run())
            _calls.LiveState.donatable = unchecked
            off.append(run())
    finally:
        _calls.LiveState.donatable = checked
    return statistics.median(on), statistics.median(off)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()
    print("check before a donating call, µs per call (medians of paired rounds)")
    for name, sizes in MODELS.items():
        leaves, on, off = check_cost(sizes, args.rounds, args.reps)
        print(f"  {name:7s} {leaves:4d} leaves: with check {on:6.2f}  without {off:6.2f}  "
              f"check {on - off:6.2f}")  # fmt: skip
    on, off = epoch_cost(args.rounds, args.epochs)
    print(f"fit, digits MLP, ms per epoch (one call each): with check {on:.3f}  "
          f"without {off:.3f}  ratio {on / off:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
