"""Keras 3 (JAX backend) versions of the workloads Keras expresses: the MLPs and the CNN.

What a user who picks Keras instead would write: a ``keras.Sequential`` of the same layers,
``model.compile(optimizer, loss)``, ``model.fit(x, y, batch_size=B, ...)``. Every Keras model
starts from the Flax model's initial weights (copied layer by layer), trains with the same
optimizer settings (optax's ``adam`` epsilon, the tutorial's ``adamw``) and is fed the same
batches in the same order: the whole run's batches, epoch after epoch in the order
``Trainer.fit(seed=0)`` draws them, as ONE Keras epoch with ``shuffle=False``. So its final
losses compare with the Flax variants' up to rounding (Keras's Adam adds epsilon to
``sqrt(v)`` where optax adds it to ``sqrt(v_hat)``; ``AdamW`` decays before the step).

Needs the ``bench`` extra (``pip install -e '.[bench]'``) and ``KERAS_BACKEND=jax``, which
:func:`import_keras` sets when the variable is unset (it refuses another backend).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from _workloads import CNN, MLP, Nodes, Workload


def keras_installed() -> bool:
    return importlib.util.find_spec("keras") is not None


def import_keras() -> Any:
    """``keras`` on the JAX backend, or None when it is not installed."""
    if not keras_installed():
        return None
    backend = os.environ.setdefault("KERAS_BACKEND", "jax")
    if backend != "jax":
        raise SystemExit(f"KERAS_BACKEND={backend!r}: the Keras variants need 'jax'")
    import keras

    return keras


def expressible(workload: Workload) -> bool:
    """Whether Keras has a model for this workload (the MLPs and the tutorial CNN)."""
    return workload.name in ("mlp_digits", "mlp_compute", "mlp_keras", "cnn_8x8", "cnn_28x28")


def _dense(layer: Any) -> list:
    return [np.asarray(layer.kernel[...]), np.asarray(layer.bias[...])]


def _mlp(keras: Any, model: MLP) -> tuple[Any, Callable[[], list]]:
    layers = [keras.Input((model.layers[0].in_features,))]
    for i, linear in enumerate(model.layers):
        last = i == len(model.layers) - 1
        layers.append(keras.layers.Dense(linear.out_features, None if last else "relu"))
    return keras.Sequential(layers), lambda: [_dense(linear) for linear in model.layers]


def _cnn(keras: Any, model: CNN, size: int) -> tuple[Any, Callable[[], list]]:
    """The tutorial CNN: conv, dropout, batch norm, relu, pool (twice), then two dense."""
    L = keras.layers

    def norm():  # nnx.BatchNorm's defaults
        return L.BatchNormalization(momentum=0.99, epsilon=1e-5)

    layers = [
        keras.Input((size, size, 1)),
        L.Conv2D(32, 3, padding="same"), L.Dropout(0.025), norm(), L.ReLU(),
        L.AveragePooling2D(2),
        L.Conv2D(64, 3, padding="same"), norm(), L.ReLU(), L.AveragePooling2D(2),
        L.Flatten(), L.Dense(256), L.Dropout(0.025), L.ReLU(), L.Dense(10),
    ]  # fmt: skip

    def bn(b):
        return [np.asarray(v[...]) for v in (b.scale, b.bias, b.mean, b.var)]

    def weights():
        return [
            _dense(model.conv1), bn(model.batch_norm1), _dense(model.conv2),
            bn(model.batch_norm2), _dense(model.linear1), _dense(model.linear2),
        ]  # fmt: skip

    return keras.Sequential(layers), weights


class KerasRun:
    """One Keras model for one workload, built from the Flax nodes' initial weights.

    ``build(nodes)`` makes the Keras model (untimed, like the Flax models' construction);
    ``train(steps_per_execution)`` compiles and fits it on the run's batches, returning the
    last workload epoch's mean training loss.
    """

    def __init__(self, keras: Any, workload: Workload):
        self.keras, self.workload = keras, workload
        order = np.concatenate([workload.batch_indices(e) for e in range(workload.epochs)])
        order = order.reshape(-1)
        data = workload.data
        if workload.name.startswith("cnn"):
            self.x, self.y = data["image"][order], data["label"][order]
        else:
            self.x, self.y = data["x"][order], data["y"][order]
        self.model: Any = None

    def build(self, nodes: Nodes, copy_weights: bool = True) -> Any:
        """The Keras model (``self.model``), with the Flax nodes' initial weights unless
        ``copy_weights`` is False (then Keras's own initializers' weights)."""
        keras, model = self.keras, nodes[0]
        if isinstance(model, CNN):
            self.model, weights = _cnn(keras, model, self.x.shape[1])
        else:
            self.model, weights = _mlp(keras, model)
        if not copy_weights:
            return self.model
        layers = [layer for layer in self.model.layers if layer.weights]
        for layer, w in zip(layers, weights(), strict=True):
            layer.set_weights(w)
        return self.model

    def optimizer(self) -> Any:
        optimizers = self.keras.optimizers
        if self.workload.name.startswith("cnn"):  # optax.adamw(0.005, 0.9): b1 = 0.9
            return optimizers.AdamW(learning_rate=0.005, beta_1=0.9, weight_decay=1e-4)
        return optimizers.Adam(learning_rate=1e-3, epsilon=1e-8)

    def compile(self, steps_per_execution: int) -> None:
        """``model.compile``: the tutorial's accuracy metric for the CNN."""
        metrics = ["accuracy"] if self.workload.name.startswith("cnn") else None
        self.model.compile(
            optimizer=self.optimizer(),
            loss=self.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=metrics, steps_per_execution=steps_per_execution,
        )  # fmt: skip

    def fit(self) -> float:
        """Trains the run's batches once (one Keras epoch); the last workload epoch's mean
        loss, from Keras's running means where a logged step ends the epoch before it."""
        w = self.workload
        means: dict[int, float] = {}
        log = self.keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: means.__setitem__(batch + 1, logs["loss"])
        )
        self.model.fit(
            self.x, self.y, batch_size=w.batch_size, epochs=1, shuffle=False, verbose=0,
            callbacks=[log],
        )  # fmt: skip
        jax.block_until_ready([v.value for v in self.model.variables])  # the trained model
        last, first = w.steps, w.steps - w.steps_per_epoch
        if last not in means:
            return float("nan")
        if first == 0:
            return float(means[last])
        if first not in means:
            return float("nan")
        return float((last * means[last] - first * means[first]) / w.steps_per_epoch)


def keras_variant(spe: Callable[[Workload], int]) -> Any:
    """A variant of ``bench_wholerun``: ``prepare`` builds the Keras model (untimed; Keras
    is imported then), the timed part compiles and fits it with
    ``steps_per_execution=spe(workload)``."""

    class Variant:
        def prepare(self, workload: Workload, nodes: Nodes) -> KerasRun:
            run = KerasRun(import_keras(), workload)
            run.build(nodes)
            return run

        def __call__(self, workload: Workload, nodes: Nodes, run: KerasRun) -> Callable:
            run.compile(spe(workload))
            return run.fit

    return Variant()
