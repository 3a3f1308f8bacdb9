"""``nnxscan demo hypernet-cl``: continual learning with a hypernetwork, against fine-tuning.

scikit-learn's digits are split into 5 tasks of 2 classes each (0/1, 2/3, ..., 8/9), learned
one after another (task-incremental: the task id is known, each task has its own 2-way
output). Two learners see the same tasks in the same order:

- a :class:`~nnxscan.pure.hyper.ConditionalHypernetwork` with one learned embedding per task
  and chunked heads (smaller than the network it generates), trained on each task with
  von Oswald et al.'s output regularizer, which keeps the weights it generates for earlier
  tasks where they were;
- the same network 64→100→2, trained directly and fine-tuned task by task (the forgetting
  baseline: each task's 2-way output overwrites the last).

:func:`~nnxscan.shell.train_tasks` trains both and records each task's held-out accuracy
after every task; the demo prints both matrices and draws them side by side.

Each learner compiles one training program and one evaluation program for all five tasks:
every task's train and test sets are cut to the smallest task's sizes, the task id rides
with the batch, and the hypernetwork's snapshot of earlier tasks is state of the model
(:class:`ContinualLearner`), masked by ``output_regularizer(..., where=...)``, not a
constant closed over by a per-task loss.
"""

from __future__ import annotations

import os
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nnxscan.adapters._extras import require_extra
from nnxscan.pure import build_compiled, hyper
from nnxscan.pure.checks import check_count
from nnxscan.shell.continual import train_tasks
from nnxscan.shell.demos._arguments import DemoArguments, demo_arguments, demo_plot_path
from nnxscan.shell.demos.digits import digits_split

__all__ = ["format_accuracy_matrix", "run_hypernet_cl_demo", "split_tasks"]

NUM_TASKS = 5
HIDDEN = 100
LEARNING_RATE = 1e-3
BATCH_SIZE = 32


class TaskNet(nnx.Module):
    """The target: an MLP 64→100→2 on the 8x8 digits, one 2-way output (for one task)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, HIDDEN, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.hidden(x)))


def split_tasks(data: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Task ``k`` holds the digits ``2k`` and ``2k + 1``, relabelled 0 and 1, and its id."""
    tasks = []
    for k in range(NUM_TASKS):
        keep = data["y"] // 2 == k
        y = data["y"][keep] - 2 * k
        tasks.append({"x": data["x"][keep], "y": y, "task": np.full(len(y), k, np.int32)})
    return tasks


def equal_sizes(tasks: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """Every task's data cut to the smallest task's size: one shape, so one program."""
    n = min(len(task["y"]) for task in tasks)
    return [{key: value[:n] for key, value in task.items()} for task in tasks]


def build_hypernetwork(seed: int) -> hyper.ConditionalHypernetwork:
    """5 task embeddings of 8 → trunk 8→32 → chunks of 64 of the target's 6,702 weights."""
    trunk = nnx.Sequential(nnx.Linear(8, 32, rngs=nnx.Rngs(seed + 1)), nnx.tanh)
    return hyper.ConditionalHypernetwork(
        TaskNet(rngs=nnx.Rngs(seed)),
        trunk,
        32,
        num_conditions=NUM_TASKS,
        embedding_features=8,
        chunk_size=64,
        chunk_embedding_features=8,
        chunk_hidden_features=16,
        rngs=nnx.Rngs(seed + 2),
    )


class ContinualLearner(nnx.Module):
    """A conditional hypernetwork, and what it generated for the earlier tasks, as state.

    ``stored`` holds a row per task (``(num_conditions, spec.size)``, in the heads' own
    order, as ``hnet.generate_vectors()`` gives them), ``num_earlier``
    how many of them are snapshots of earlier tasks, and ``snapshot`` whether the next
    training step is a task's first, which takes the snapshot: all plain ``nnx.Variable``
    (not trained, not closed over by the loss), so every task's training step has the same
    shapes and one compiled program serves them all.
    """

    def __init__(self, hnet: hyper.ConditionalHypernetwork):
        self.hnet = hnet
        size = hnet.spec.size
        self.stored = nnx.Variable(jnp.zeros((hnet.num_conditions, size), jnp.float32))
        self.num_earlier = nnx.Variable(jnp.zeros((), jnp.int32))
        self.snapshot = nnx.Variable(jnp.ones((), bool))


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def hypernetwork_losses(beta: float):
    """``loss_for_task`` for :func:`train_tasks`: the task's loss plus the regularizer.

    Before task ``t`` trains, it writes ``t`` and "take the snapshot" into the learner's
    state; the task's first step then stores every task's generated weights (rows ``>= t``
    are masked out) before its update. The loss it returns is the same function for every
    task (the task id comes with the batch), so the Trainer compiles it once, and each
    step generates every task's weights once, for the regularizer and the task's forward.
    """

    def loss_fn(learner: ContinualLearner, batch: dict[str, jax.Array]) -> jax.Array:
        hnet = learner.hnet
        # Every task's weights, generated once, as vectors in the heads' own order (the
        # regularizer compares them entry by entry with snapshots taken the same way, so
        # no kernel is moved to the target's order and back): the earlier rows are
        # regularized, the current task's row runs the target (one generator, not two).
        now = hnet.generate_vectors()
        params = hnet.params_of(now[batch["task"][0]])
        # hyper.call returns the output only: fine for these targets, whose forward changes
        # no state of their own (a BatchNorm target would run through hnet instead).
        task_loss = cross_entropy(hyper.call(hnet.spec, params, batch["x"]), batch["y"])
        # The task's first step takes the snapshot: the weights generated before any of
        # its updates, inside the same program (no program of its own, no host round trip).
        stored = jnp.where(learner.snapshot[...], jax.lax.stop_gradient(now), learner.stored[...])
        learner.stored[...] = stored
        learner.snapshot[...] = jnp.zeros((), bool)
        earlier = jnp.arange(hnet.num_conditions) < learner.num_earlier[...]
        # The rows generated above are the regularizer's inputs, each standing for itself
        # (not `now[i]` of an id: a gather, whose gradient is a scatter).
        return task_loss + hyper.output_regularizer(
            lambda row: {"theta": row}, now, stored, beta, where=earlier
        )

    def loss_for_task(t: int, learner: ContinualLearner):
        # set_value, not `[...] =`: outside a trace that would compile a scatter; and
        # device_put of NumPy values, where jnp.asarray compiles a small program each.
        learner.snapshot.set_value(jax.device_put(np.asarray(True)))
        learner.num_earlier.set_value(jax.device_put(np.asarray(t, np.int32)))
        return loss_fn

    return loss_for_task


def hypernetwork_accuracy(learner: ContinualLearner, batch: dict[str, jax.Array]) -> jax.Array:
    return jnp.mean(learner.hnet(batch["task"][0], batch["x"]).argmax(-1) == batch["y"])


def fine_tuning_loss(model: TaskNet, batch: dict[str, jax.Array]) -> jax.Array:
    return cross_entropy(model(batch["x"]), batch["y"])


def fine_tuning_accuracy(model: TaskNet, batch: dict[str, jax.Array]) -> jax.Array:
    return jnp.mean(model(batch["x"]).argmax(-1) == batch["y"])


def baseline_loss(t: int, model: TaskNet):
    # Fine-tuning: the same loss on every task, no memory of earlier ones. One function for
    # all tasks, so the Trainer compiles it once.
    del t, model
    return fine_tuning_loss


def format_accuracy_matrix(title: str, acc: np.ndarray) -> str:
    """A plain-text table: a row per "after task i", a column per task, then the mean."""
    n = acc.shape[0]
    lines = [
        title,
        f"{'':>13}" + "".join(f"{f'task {j + 1}':>9}" for j in range(n)) + f"{'mean':>9}",
    ]
    for i in range(n):
        cells = "".join(f"{acc[i, j]:>9.1%}" if j <= i else f"{'':>9}" for j in range(n))
        lines.append(f"{f'after task {i + 1}':>13}{cells}{np.mean(acc[i, : i + 1]):>9.1%}")
    return "\n".join(lines)


def draw_accuracy_matrices(matrices: dict[str, np.ndarray]) -> Any:
    """A matplotlib Figure: one heat map per learner, rows "after task i", columns tasks."""
    Figure = require_extra("matplotlib.figure", "demo", needed_by="nnxscan demo hypernet-cl").Figure
    fig = Figure(figsize=(11, 4.8), layout="constrained")
    axes = fig.subplots(1, len(matrices))
    image = None
    for ax, (name, acc) in zip(axes, matrices.items(), strict=True):
        n = acc.shape[0]
        image = ax.imshow(np.ma.masked_invalid(acc), vmin=0.5, vmax=1.0, cmap="viridis")
        for i in range(n):
            for j in range(i + 1):
                color = "black" if acc[i, j] > 0.8 else "white"
                ax.text(j, i, f"{acc[i, j]:.0%}", ha="center", va="center", color=color)
        ax.set_xticks(range(n), [f"{2 * j}/{2 * j + 1}" for j in range(n)])
        ax.set_yticks(range(n), [str(i + 1) for i in range(n)])
        ax.set_xlabel("task evaluated (digits)")
        ax.set_ylabel("after training task")
        ax.set_title(f"{name}\nfinal average {np.mean(acc[-1]):.1%}")
    fig.colorbar(image, ax=list(axes), label="held-out accuracy", shrink=0.8)
    fig.suptitle("Split digits, 5 tasks learned in sequence")
    return fig


def run_hypernet_cl_demo(
    out_dir: str | os.PathLike[str] = ".",
    *,
    epochs: int = 30,
    beta: float = 0.05,
    **options: Unpack[DemoArguments],
) -> dict[str, Any]:
    """Learns 5 split-digits tasks in sequence, with a hypernetwork and with fine-tuning.

    Prints both accuracy matrices (held-out accuracy of each task after every task), the
    final average accuracy of each, and how much task 1 lost; writes both matrices to
    ``<out_dir>/nnxscan_demo_hypernet-cl.png`` (``out_dir`` is created if missing).

    Args:
      out_dir: folder for the PNG.
      epochs: epochs per task (8 steps of 32 examples each: every task's training and
        test sets are cut to the smallest task's sizes, 280 and 66 examples for seed 0,
        so all tasks share one training program and one evaluation program).
      beta: the output regularizer's strength.
      **options: ``seed`` (0) seeds the train/test split, the initial weights and the
        shuffling; ``progress`` (True) shows the Trainer's progress bars.

    Returns:
      ``{"hypernetwork": 5x5 nested list, "baseline": 5x5 nested list (NaN above the
      diagonal), "final_average": {"hypernetwork": float, "baseline": float},
      "task1_drop": {...} (accuracy right after task 1 minus at the end), "compression_ratio":
      the hypernetwork's parameters over the target's, "plot": the PNG's absolute path}``.

    Example:
      >>> result = run_hypernet_cl_demo("/tmp/demo")
      >>> result["final_average"]["hypernetwork"] >= 0.95
      True
    """
    seed, progress = demo_arguments("run_hypernet_cl_demo", options)
    epochs = check_count(epochs, "epochs", 1)
    if isinstance(beta, bool) or not isinstance(beta, int | float) or not beta >= 0:
        raise ValueError(f"beta must be a number >= 0, got {beta!r}.")
    require_extra("matplotlib.figure", "demo", needed_by="nnxscan demo hypernet-cl")
    train, test = digits_split(seed)
    tasks = list(zip(equal_sizes(split_tasks(train)), equal_sizes(split_tasks(test)), strict=True))
    # Every initializer in one compiled program (eagerly, each draw compiles its own).
    hnet = build_compiled(lambda: build_hypernetwork(seed))
    print(
        f"hypernet-cl demo: split digits, {NUM_TASKS} tasks of 2 classes learned in sequence, "
        f"{epochs} epochs each.\nTarget MLP 64→{HIDDEN}→2 ({hnet.spec.size:,} weights); the "
        f"hypernetwork generating it in chunks is {hnet.compression_ratio:.2f}× its size."
    )
    fit = dict(epochs=epochs, batch_size=BATCH_SIZE, seed=seed, progress=progress)
    matrices = {
        f"hypernetwork + output regularizer (β = {beta:g})": train_tasks(
            ContinualLearner(hnet), optax.adam(LEARNING_RATE), tasks,
            hypernetwork_losses(float(beta)), lambda j: hypernetwork_accuracy,
            label="hypernetwork", **fit,
        ),
        "fine-tuned network (baseline)": train_tasks(
            build_compiled(lambda: TaskNet(rngs=nnx.Rngs(seed))), optax.adam(LEARNING_RATE), tasks,
            baseline_loss, lambda j: fine_tuning_accuracy, label="fine-tuned baseline", **fit,
        ),
    }  # fmt: skip
    hnet_acc, base_acc = matrices.values()
    plot = demo_plot_path(out_dir, "hypernet-cl")
    draw_accuracy_matrices(matrices).savefig(plot, dpi=100)

    result = {
        "hypernetwork": hnet_acc.tolist(),
        "baseline": base_acc.tolist(),
        "final_average": {"hypernetwork": float(hnet_acc[-1].mean()),
                          "baseline": float(base_acc[-1].mean())},
        "task1_drop": {"hypernetwork": float(hnet_acc[0, 0] - hnet_acc[-1, 0]),
                       "baseline": float(base_acc[0, 0] - base_acc[-1, 0])},
        "compression_ratio": float(hnet.compression_ratio),
        "plot": str(plot),
    }  # fmt: skip
    print("held-out accuracy of each task (columns) after training each task (rows):")
    for name, acc in matrices.items():
        print()
        print(format_accuracy_matrix(name, acc))
    print()
    for key, name, acc in (
        ("hypernetwork", "hypernetwork", hnet_acc),
        ("baseline", "fine-tuned baseline", base_acc),
    ):
        print(
            f"final average accuracy, {name}: {result['final_average'][key]:.1%} "
            f"(task 1: {acc[0, 0]:.1%} right after learning it, {acc[-1, 0]:.1%} at the end)"
        )  # fmt: skip
    print(f"wrote {plot}")
    return result
