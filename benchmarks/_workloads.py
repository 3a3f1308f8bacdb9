"""The workloads of ``bench_wholerun.py``: models, data, losses and their authors' steps.

Each workload is what someone would train and how its authors wrote the training step:

- ``mlp_digits``: an MLP 64→128→128→10 (``nnxscan demo``'s) on scikit-learn's 8×8 digits,
  44 steps per epoch: tiny epochs, where the per-epoch host round trip shows.
- ``mlp_compute``: an MLP 784→512→512→10 on random data: compute-bound steps.
- ``mlp_keras``: an MLP 64→64→64→10 on 64,000 random examples, 3 epochs of 2,000 steps:
  the setting issue 45 compared with Keras's ``steps_per_execution``.
- ``cnn_8x8`` / ``cnn_28x28``: the Flax NNX MNIST tutorial's CNN (BatchNorm, Dropout, call-time
  ``nnx.Rngs``, an ``nnx.MultiMetric``) and its ``train_step``, on the digits as they are and
  blown up to the tutorial's 28×28.
- ``vae``: the VAE of Flax's ``examples/nnx_toy_examples/05_vae.py`` (its Encoder keeps its
  own Rngs and stores a ``Loss`` variable that the loss pops) on binarized 28×28 digits.
- ``lm_24`` / ``lm_200``: a 2-layer byte-level decoder-only transformer on Python source
  text from the standard library, 24 and 200 steps.

Every variant trains the same batches: epoch ``e`` takes ``nnxscan.pure.epoch_order(0, e, n)``
cut into full batches, the order ``Trainer.fit(seed=0)`` uses. ``quick=True`` shrinks each
workload to 2 epochs of a few steps, to check the benchmark runs.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json.decoder
import json.encoder
import textwrap
import typing as tp
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nnxscan.pure import epoch_order

SEED = 0  # the shuffle seed of every variant (Trainer.fit's default)

# The nodes a training step takes: (model, optimizer) or, for the tutorial,
# (model, optimizer, metrics, rngs). The model is the one the step trains (a view for the
# tutorial); the optimizer is an nnx.Optimizer over it.
Nodes = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Workload:
    """One model, data set and training recipe, as its authors wrote it.

    Attributes:
      name, title: the workload's key and a one-line description for the report.
      data: the training set on the host, a pytree of numpy arrays sharing a leading
        examples axis.
      batch_size, epochs: every variant trains ``epochs`` epochs of full batches.
      loss_fn: ``loss_fn(model, batch[, rngs])``, as ``Trainer`` takes it.
      make_tx: builds the optax transform.
      make_nodes: ``make_nodes(tx)`` builds fresh, untrained nodes (see ``Nodes``) whose
        ``nnx.Optimizer`` trains with ``tx`` (``make_nodes(None)``: None in its slot).
      train_step: the authors' step, not yet jitted: ``train_step(*nodes, batch)``,
        returning the loss or (tutorial) nothing, its loss going into the metrics.
      epoch_loss: ``epoch_loss(nodes, step_outputs)`` is the epoch's mean training loss,
        read as the authors' loop reads it (resetting the metrics, for the tutorial).
      trainer_options: ``Trainer`` keyword arguments built from the nodes (the
        tutorial's ``has_aux``, ``rngs``, ``metrics``, ``update_metrics``).
      one_scan_floor: also time one compiled ``lax.scan`` over every step of the run.
    """

    name: str
    title: str
    data: Any
    batch_size: int
    epochs: int
    loss_fn: Callable[..., Any]
    make_tx: Callable[[], optax.GradientTransformation]
    make_nodes: Callable[[optax.GradientTransformation], Nodes]
    train_step: Callable[..., Any]
    epoch_loss: Callable[[Nodes, list], float]
    trainer_options: Callable[[Nodes], dict] = lambda nodes: {}
    one_scan_floor: bool = False

    def nodes(self) -> Nodes:
        """Fresh, untrained nodes."""
        return self.make_nodes(self.make_tx())

    def model_nodes(self) -> Nodes:
        """Fresh, untrained nodes without the optimizer (None in its slot): what exists
        before a run that builds its optimizer itself (``with_optimizer``)."""
        return self.make_nodes(None)

    @property
    def num_examples(self) -> int:
        return len(jax.tree.leaves(self.data)[0])

    @property
    def steps_per_epoch(self) -> int:
        return self.num_examples // self.batch_size

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def batch_indices(self, epoch: int) -> np.ndarray:
        """``(steps_per_epoch, batch_size)`` example indices of epoch ``epoch``: the batches
        ``Trainer.fit`` trains."""
        order = epoch_order(SEED, epoch, self.num_examples)
        return order[: self.steps_per_epoch * self.batch_size].reshape(-1, self.batch_size)

    def batches(self, epoch: int) -> Iterator[Any]:
        """Epoch ``epoch``'s batches, gathered on the host one at a time, as a data loader
        hands them to a training loop."""
        for idx in self.batch_indices(epoch):
            yield jax.tree.map(lambda a, idx=idx: a[idx], self.data)


# -- the authors' steps and epoch losses ------------------------------------------------------


def plain_train_step(loss_fn: Callable) -> Callable:
    """The Flax NNX training step: value_and_grad, ``optimizer.update``, return the loss."""

    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    return train_step


def mean_of_losses(nodes: Nodes, losses: list) -> float:
    return float(np.mean(jax.device_get(losses)))


def model_and_optimizer(build_model: Callable[[], nnx.Module]):
    def make_nodes(tx: optax.GradientTransformation | None) -> Nodes:
        model = build_model()
        return model, optimizer_of(model, tx)

    return make_nodes


def optimizer_of(model: nnx.Module, tx: optax.GradientTransformation | None) -> Any:
    """The authors' ``nnx.Optimizer(model, tx, wrt=nnx.Param)``; None without a ``tx``
    (the nodes of a model whose optimizer is built later: ``with_optimizer``)."""
    return None if tx is None else nnx.Optimizer(model, tx, wrt=nnx.Param)


def with_optimizer(nodes: Nodes, tx: optax.GradientTransformation) -> Nodes:
    """``nodes`` with the optimizer slot filled as the authors fill it, on the model the
    step trains (for the tutorial, its training view: it shares the model's Variables)."""
    if nodes[1] is not None:
        return nodes
    return (nodes[0], optimizer_of(nodes[0], tx), *nodes[2:])


# -- data ---------------------------------------------------------------------------------


def digits(num_examples: int) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8×8 digits in [0, 1], shuffled once: ``(images (n, 8, 8), labels)``."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))[:num_examples]
    return (x[order] / 16.0).reshape(-1, 8, 8).astype(np.float32), y[order].astype(np.int32)


def blow_up_to_28x28(images: np.ndarray) -> np.ndarray:
    """8×8 images to the tutorial's 28×28: each pixel 3×3 (24×24), then 2 pixels of border."""
    big = np.kron(images, np.ones((3, 3), np.float32))
    return np.pad(big, ((0, 0), (2, 2), (2, 2)))


# -- MLPs ---------------------------------------------------------------------------------


class MLP(nnx.Module):
    def __init__(self, sizes: tp.Sequence[int], *, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


def cross_entropy(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def mlp_digits(quick: bool) -> Workload:
    images, labels = digits(128 if quick else 1408)  # 1,408 = 44 batches of 32
    return Workload(
        name="mlp_digits",
        title="MLP 64→128→128→10 on the 8×8 digits, batch 32, adam (tiny epochs)",
        data={"x": images.reshape(-1, 64), "y": labels},
        batch_size=32,
        epochs=2 if quick else 30,
        loss_fn=cross_entropy,
        make_tx=partial(optax.adam, 1e-3),
        make_nodes=model_and_optimizer(lambda: MLP([64, 128, 128, 10], rngs=nnx.Rngs(0))),
        train_step=plain_train_step(cross_entropy),
        epoch_loss=mean_of_losses,
        one_scan_floor=True,
    )


def random_mlp(
    name: str, title: str, sizes: list[int], quick: bool, examples: int, batch_size: int, seed: int
) -> Workload:
    """An MLP of ``sizes`` on ``examples`` random inputs (512 when ``quick``), 3 epochs of
    adam (2 when ``quick``); the labels a linear teacher gives, so the loss falls and final
    losses can be compared."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(512 if quick else examples, sizes[0])).astype(np.float32)
    y = (x @ rng.normal(size=(sizes[0], sizes[-1]))).argmax(-1).astype(np.int32)
    return Workload(
        name=name,
        title=title,
        data={"x": x, "y": y},
        batch_size=batch_size,
        epochs=2 if quick else 3,
        loss_fn=cross_entropy,
        make_tx=partial(optax.adam, 1e-3),
        make_nodes=model_and_optimizer(lambda: MLP(sizes, rngs=nnx.Rngs(0))),
        train_step=plain_train_step(cross_entropy),
        epoch_loss=mean_of_losses,
    )


def mlp_compute(quick: bool) -> Workload:
    title = "MLP 784→512→512→10 on random data, batch 128, adam (compute-bound steps)"
    return random_mlp("mlp_compute", title, [784, 512, 512, 10], quick, 4096, 128, 0)


def mlp_keras(quick: bool) -> Workload:
    """Issue 45's Keras comparison: many tiny steps, where Keras's ``steps_per_execution``
    runs its own loop of steps."""
    title = "MLP 64→64→64→10 on random data, batch 32, adam (Keras's many-step setting)"
    return random_mlp("mlp_keras", title, [64, 64, 64, 10], quick, 64_000, 32, 1)


# -- the Flax NNX MNIST tutorial (flax 0.12.8 docs_nnx/mnist_tutorial), verbatim ------------


class CNN(nnx.Module):
    """A simple CNN model."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        x = self.linear2(x)
        return x


def loss_fn(model: CNN, batch, rngs: nnx.Rngs | None = None):
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]
    ).mean()
    return loss, logits


def train_step(model, optimizer, metrics, rngs, batch):  # the tutorial decorates it @nnx.jit
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch, rngs)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


class CNN8x8(CNN):
    """The tutorial's CNN for 8×8 inputs, the one edit: two pools leave 2×2×64 = 256
    features for ``linear1`` instead of 7×7×64 = 3136."""

    def __init__(self, *, rngs: nnx.Rngs):
        super().__init__(rngs=rngs)
        self.linear1 = nnx.Linear(2 * 2 * 64, 256, rngs=rngs)


def update_metrics(metrics, loss, logits, batch):
    metrics.update(loss=loss, logits=logits, labels=batch["label"])


def tutorial_nodes(cnn: type[CNN]) -> Callable[[optax.GradientTransformation], Nodes]:
    def make_nodes(tx: optax.GradientTransformation | None) -> Nodes:
        model = cnn(rngs=nnx.Rngs(0))
        optimizer = optimizer_of(model, tx)
        metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
        train_model = nnx.view(model, deterministic=False, use_running_average=False)
        return train_model, optimizer, metrics, nnx.Rngs(0)

    return make_nodes


def tutorial_epoch_loss(nodes: Nodes, outputs: list) -> float:
    """The tutorial's loop reads its metrics, then resets them."""
    metrics = nodes[2]
    loss = float(metrics.compute()["loss"])
    metrics.reset()
    return loss


def tutorial_trainer_options(nodes: Nodes) -> dict:
    """``Trainer`` options that port the tutorial's step (docs/porting.md)."""
    _, _, metrics, rngs = nodes
    return dict(has_aux=True, rngs=rngs, metrics=metrics, update_metrics=update_metrics)


def tutorial_cnn(name: str, quick: bool) -> Workload:
    images, labels = digits(128 if quick else 1408)
    if name == "cnn_8x8":
        cnn, size, epochs = CNN8x8, "8×8", 28
    else:
        cnn, size, epochs, images = CNN, "28×28", 3, blow_up_to_28x28(images)
    return Workload(
        name=name,
        title=f"Flax NNX MNIST tutorial CNN and loop, {size} digits, batch 32, adamw",
        data={"image": images[..., None], "label": labels},
        batch_size=32,
        epochs=2 if quick else epochs,
        loss_fn=loss_fn,
        make_tx=partial(optax.adamw, 0.005, 0.9),
        make_nodes=tutorial_nodes(cnn),
        train_step=train_step,
        epoch_loss=tutorial_epoch_loss,
        trainer_options=tutorial_trainer_options,
    )


# -- the VAE of flax examples/nnx_toy_examples/05_vae.py, verbatim --------------------------


class Loss(nnx.Variable):
    pass


class Encoder(nnx.Module):
    def __init__(self, din: int, dmid: int, dout: int, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
        self.linear_mean = nnx.Linear(dmid, dout, rngs=rngs)
        self.linear_std = nnx.Linear(dmid, dout, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape((x.shape[0], -1))  # flatten
        x = self.linear1(x)
        x = jax.nn.relu(x)

        mean = self.linear_mean(x)
        std = jnp.exp(self.linear_std(x))

        self.kl_loss = Loss(
            jnp.mean(0.5 * jnp.mean(-jnp.log(std**2) - 1.0 + std**2 + mean**2, axis=-1))
        )
        key = self.rngs.noise()
        z = mean + std * jax.random.normal(key, mean.shape)
        return z


class Decoder(nnx.Module):
    def __init__(self, din: int, dmid: int, dout: int, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
        self.linear2 = nnx.Linear(dmid, dout, rngs=rngs)

    def __call__(self, z: jax.Array) -> jax.Array:
        z = self.linear1(z)
        z = jax.nn.relu(z)
        logits = self.linear2(z)
        return logits


class VAE(nnx.Module):
    def __init__(
        self,
        din: int,
        hidden_size: int,
        latent_size: int,
        output_shape: tp.Sequence[int],
        *,
        rngs: nnx.Rngs,
    ):
        self.output_shape = output_shape
        self.encoder = Encoder(din, hidden_size, latent_size, rngs=rngs)
        self.decoder = Decoder(latent_size, hidden_size, int(np.prod(output_shape)), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        z = self.encoder(x)
        logits = self.decoder(z)
        logits = jnp.reshape(logits, (-1, *self.output_shape))
        return logits


def vae_loss(model: VAE, x: jax.Array):
    """The example's ``loss_fn``, which closes over the batch ``x`` inside its
    ``train_step``, with ``x`` as an argument: ``loss_fn(model, batch)``."""
    logits = model(x)
    losses = nnx.pop(model, Loss)
    kl_loss = sum(jax.tree_util.tree_leaves(losses), 0.0)
    reconstruction_loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, x))
    loss = reconstruction_loss + 0.1 * kl_loss
    return loss


def vae(quick: bool) -> Workload:
    images, _ = digits(256 if quick else 1408)  # 1,408 = 22 batches of 64
    # The example binarizes MNIST with ``> 0``; it trains with batch indices drawn at random
    # (with replacement): here every variant gets the same permutation batches.
    binary = (blow_up_to_28x28(images) > 0).astype(np.float32)
    return Workload(
        name="vae",
        title="Flax NNX examples' VAE on binarized 28×28 digits, batch 64, adam",
        data=binary,
        batch_size=64,
        epochs=2 if quick else 5,
        loss_fn=vae_loss,
        make_tx=partial(optax.adam, 1e-3),
        make_nodes=model_and_optimizer(
            lambda: VAE(784, 256, 32, (28, 28), rngs=nnx.Rngs(0, noise=1))
        ),
        train_step=plain_train_step(vae_loss),
        epoch_loss=mean_of_losses,
    )


# -- a byte-level decoder-only transformer ----------------------------------------------------

CONTEXT = 64


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention, then a 4× GELU MLP."""

    def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs):
        self.attention_norm = nnx.LayerNorm(width, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            heads, width, decode=False, keep_rngs=False, rngs=rngs
        )
        self.mlp_norm = nnx.LayerNorm(width, rngs=rngs)
        self.mlp_in = nnx.Linear(width, 4 * width, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attention(self.attention_norm(x), mask=mask)
        return x + self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(x))))


class ByteLM(nnx.Module):
    """2 blocks of width 128 and 4 heads over bytes, learned positional embeddings."""

    def __init__(self, *, layers=2, width=128, heads=4, vocab=256, rngs: nnx.Rngs):
        self.token_embedding = nnx.Embed(vocab, width, rngs=rngs)
        self.position_embedding = nnx.Embed(CONTEXT, width, rngs=rngs)
        self.blocks = nnx.List([Block(width, heads, rngs=rngs) for _ in range(layers)])
        self.final_norm = nnx.LayerNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens):
        positions = jnp.arange(tokens.shape[-1])
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.final_norm(x))


def next_byte_loss(model, tokens):
    """Predict each byte from the ones before it: ``tokens`` is ``(batch, CONTEXT + 1)``."""
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def source_windows(num_windows: int) -> np.ndarray:
    """``(num_windows, CONTEXT + 1)`` consecutive byte windows of Python standard-library
    source (the text repeats when more is asked for than there is)."""
    text = "".join(inspect.getsource(m) for m in (json.decoder, json.encoder, textwrap))
    data = np.frombuffer(text.encode(), np.uint8)
    data = np.resize(data, num_windows * CONTEXT + 1).astype(np.int32)
    starts = np.arange(num_windows) * CONTEXT
    return data[starts[:, None] + np.arange(CONTEXT + 1)]


def byte_lm(name: str, quick: bool) -> Workload:
    steps = {"lm_24": 24, "lm_200": 200}[name]
    batch_size = 16
    epochs, steps_per_epoch = (2, 2) if quick else (1, steps)
    return Workload(
        name=name,
        title=(
            f"byte-level transformer LM (2 layers, width 128, 4 heads, context {CONTEXT}), "
            f"batch {batch_size}, adam, {steps} steps in one epoch"
        ),
        data=source_windows(steps_per_epoch * batch_size),
        batch_size=batch_size,
        epochs=epochs,
        loss_fn=next_byte_loss,
        make_tx=partial(optax.adam, 1e-3),
        make_nodes=model_and_optimizer(lambda: ByteLM(rngs=nnx.Rngs(0))),
        train_step=plain_train_step(next_byte_loss),
        epoch_loss=mean_of_losses,
    )


WORKLOADS: dict[str, Callable[[bool], Workload]] = {
    "mlp_digits": mlp_digits,
    "mlp_compute": mlp_compute,
    "mlp_keras": mlp_keras,
    "cnn_8x8": partial(tutorial_cnn, "cnn_8x8"),
    "cnn_28x28": partial(tutorial_cnn, "cnn_28x28"),
    "vae": vae,
    "lm_24": partial(byte_lm, "lm_24"),
    "lm_200": partial(byte_lm, "lm_200"),
}
