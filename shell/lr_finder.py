"""A learning-rate range test as a population: N rates trained side by side, one program
(:func:`find_learning_rate`; member ``i`` trains what a ``Trainer`` at ``rates[i]`` trains).
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from nnxscan.adapters import _plots
from nnxscan.pure import epoch_order
from nnxscan.pure.checks import check_count, check_leading_size
from nnxscan.shell._engine.streaming import CHUNK_BYTES, is_stream
from nnxscan.shell._population_checks import check_model_fn
from nnxscan.shell._user_steps import check_loss_fn
from nnxscan.shell.population import Population

__all__ = ["LRFinderResult", "find_learning_rate"]

#: The default ``tolerance`` of the suggestion rule (10% above the best final loss).
DEFAULT_TOLERANCE = 0.1
#: A rate whose final loss ends above this many times the starting loss diverged (fastai's
#: range test stops there): a rate too small to learn stays near the start, within noise.
DIVERGENCE_FACTOR = 4.0


@dataclasses.dataclass(frozen=True)
class LRFinderResult:
    """What :func:`find_learning_rate` measured: one column per learning rate.

    Attributes:
      learning_rates: the rates tried, shape ``(N,)``, log-spaced, ascending.
      losses: the training loss of every step and rate, shape ``(steps, N)`` (each step's
        loss before its update, as ``History.losses``). A diverged rate's column is NaN
        from its first non-finite step on.
      final_losses: each rate's final loss, shape ``(N,)``: the mean of its last
        ``window`` losses (NaN for a rate whose loss became non-finite).
      diverged: shape ``(N,)`` bool: the rate blew up: its loss became non-finite (NaN or
        inf), or its final loss is above 4 times the loss every copy started from
        (``losses[0]``; precisely ``start + 3 * |start|``).
      window: how many final steps ``final_losses`` averages.
      tolerance: the tolerance ``suggestion`` was chosen with (see :meth:`suggest`).
      suggestion: the suggested learning rate (see :meth:`suggest`), or None when every
        rate diverged.

    Example:
      >>> result = find_learning_rate(MLP, loss_fn, data, batch_size=32)
      >>> result.losses.shape, result.suggestion
      ((300, 16), 0.0031622776601683794)
      >>> model = MLP(nnx.Rngs(0))
      >>> Trainer(model, optax.adam(result.suggestion), loss_fn).fit(data, epochs=5, batch_size=32)
    """

    learning_rates: np.ndarray
    losses: np.ndarray
    final_losses: np.ndarray
    diverged: np.ndarray
    window: int
    tolerance: float
    suggestion: float | None

    @property
    def best(self) -> int | None:
        """The index of the rate with the lowest final loss among those that did not
        diverge (None when every rate diverged)."""
        kept = ~self.diverged & np.isfinite(self.final_losses)
        finite = np.where(kept, self.final_losses, np.inf)
        return None if np.isinf(finite).all() else int(np.argmin(finite))

    def suggest(self, tolerance: float | None = None) -> float | None:
        """The suggested rate: the SMALLEST rate whose final loss is within ``tolerance``
        of the best, among the rates that did not diverge.

        "Within ``tolerance``" means ``final_loss <= best + tolerance * |best|``, where
        ``best`` is the lowest final loss of a rate that did not diverge. Of the rates that
        trained about as well as the best one in this short run, the most cautious is
        taken: the best constant rate of a longer run is usually lower than the best of a
        short one, and a rate at the edge of divergence here may diverge later.
        ``tolerance=0`` gives the rate with the lowest final loss itself.

        Args:
          tolerance: a non-negative fraction (default: the one the finder ran with).

        Returns:
          A learning rate from :attr:`learning_rates`, or None when every rate diverged.

        Example:
          >>> result.suggest()            # the rule at the finder's tolerance
          0.0031622776601683794
          >>> result.suggest(0.0)         # the lowest final loss itself
          0.01
        """
        tolerance = _check_number(self.tolerance if tolerance is None else tolerance, "tolerance")
        best = self.best
        if best is None:
            return None
        lowest = self.final_losses[best]
        kept = ~self.diverged & np.isfinite(self.final_losses)
        near = kept & (self.final_losses <= lowest + tolerance * abs(lowest))
        return float(self.learning_rates[np.flatnonzero(near)[0]])

    def table(self) -> str:
        """A plain-text table: one row per rate, its final loss, and a note for the rate
        suggested, the rate with the lowest final loss, and the rates that diverged.

        Example:
          >>> print(result.table())
          learning rate   final loss
                  1e-05       2.2451
          ...
        """
        best = self.best
        lines = [f"{'learning rate':>13} {'final loss':>12}"]
        for i, (rate, loss) in enumerate(zip(self.learning_rates, self.final_losses, strict=True)):
            notes = []
            if self.suggestion is not None and rate == self.suggestion:
                notes.append("suggested")
            if i == best:
                notes.append("lowest final loss")
            if self.diverged[i]:
                notes.append("diverged")
            cell = f"{loss:>12.4g}" if np.isfinite(loss) else f"{'-':>12}"
            lines.append(f"{rate:>13.3g} {cell}" + (f"   {', '.join(notes)}" if notes else ""))
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str] | None = None) -> Any:
        """Draws two panels and returns the matplotlib ``Figure`` (written to ``path`` as a
        PNG when given, its folder created when missing); pyplot's global state is not
        touched. Needs matplotlib: ``pip install 'nnxscan[demo]'``.

        Left: the training loss against the step, one line per rate (coloured from the
        smallest rate, dark, to the largest, light; a log y-axis when every loss is
        positive), each step's loss averaged with the ``window - 1`` steps before it (fewer
        at the start), so that each line ends at its rate's final loss. Right: the final
        loss against the rate on a logarithmic x-axis, a line through the rates that did
        not diverge; each diverged rate a cross (at its final loss when that is finite,
        else at the top); the starting loss dotted; the band the suggestion rule accepts
        shaded; a dashed vertical line at the suggestion.

        Example:
          >>> fig = result.plot("lr_find.png")
          >>> [ax.get_xscale() for ax in fig.axes]
          ['linear', 'log']
        """
        return _plots.lr_finder_plot(self, path)


def find_learning_rate(
    model_fn: Callable[[nnx.Rngs], nnx.Module],
    loss_fn: Callable[..., Any],
    data: Any,
    *,
    batch_size: int,
    min_lr: float = 1e-5,
    max_lr: float = 1.0,
    num: int = 16,
    steps: int = 300,
    optimizer: Callable[..., optax.GradientTransformation] = optax.adam,
    seed: int = 0,
    window: int | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    has_aux: bool = False,
    wrt: nnx.filterlib.Filter = nnx.Param,
    steps_per_call: int | None = None,
    progress: bool = False,
) -> LRFinderResult:
    """Trains ``num`` copies of a model at ``num`` log-spaced learning rates side by side,
    in one compiled program, and suggests a rate.

    Every copy starts from the same weights (``model_fn(nnx.Rngs(seed))``) and trains on
    the same batches: those ``Trainer.fit(data, batch_size=batch_size, seed=seed)`` visits
    (each epoch shuffled by ``epoch_order(seed, epoch, n)``, the final short batch dropped),
    for ``steps`` steps, crossing epochs as needed. Only the learning rate differs, so copy
    ``i``'s curve is what ``Trainer(model_fn(nnx.Rngs(seed)), optimizer(rates[i]),
    loss_fn)`` would train alone (equal up to float rounding). A copy whose loss becomes
    non-finite is frozen there (``on_nonfinite="stop"``) while the others go on.

    The suggestion (:meth:`LRFinderResult.suggest`): the SMALLEST rate whose final loss
    (the mean of its last ``window`` losses) is within ``tolerance`` of the lowest final
    loss, ``final <= best + tolerance * |best|``, among the rates that did not diverge (a
    non-finite loss, or a final loss above 4 times the starting loss).

    Args:
      model_fn: ``model_fn(rngs) -> nnx.Module``, called with ``nnx.Rngs(seed)``.
      loss_fn: ``loss_fn(model, batch)``, a scalar (``(loss, aux)`` with ``has_aux``).
      data: a data set: a pytree of arrays sharing a leading examples axis.
      batch_size: examples per step.
      min_lr, max_lr: the smallest and largest rate (``0 < min_lr < max_lr``).
      num: how many rates, log-spaced from ``min_lr`` to ``max_lr`` (at least 2).
      steps: steps each rate trains.
      optimizer: an optax optimizer factory called as ``optimizer(learning_rate=rate)``
        (``optax.adam``, ``optax.sgd``, or your own function that returns a
        GradientTransformation); it is wrapped in ``optax.inject_hyperparams``.
      seed: the initial weights and the shuffle of every copy.
      window: how many final steps ``final_losses`` averages (default: a tenth of
        ``steps``, at least 1).
      tolerance: the suggestion rule's tolerance, a non-negative fraction (default 0.1).
      has_aux, wrt: as for ``Trainer``.
      steps_per_call: steps per compiled call (default: all ``steps`` in one call when
        their batches fit in 256 MiB, else as few equal calls as fit). Every call runs
        the same compiled program (a shorter last call compiles once more).
      progress: show a progress bar (it moves once per call).

    Returns:
      An :class:`LRFinderResult`: ``learning_rates`` ``(num,)``, ``losses`` ``(steps,
      num)``, ``final_losses``, ``diverged``, ``suggestion``, ``table()`` and ``plot()``.

    Raises:
      TypeError, ValueError: an argument is of the wrong kind or out of range; raised
        before anything is built or compiled.

    Example:
      >>> result = find_learning_rate(MLP, loss_fn, data, batch_size=32, steps=200)
      >>> result.suggestion
      0.0031622776601683794
      >>> print(result.table())
      >>> result.plot("lr_find.png")
    """
    check_model_fn(model_fn)
    check_loss_fn(loss_fn)
    n = _check_data(data)
    batch_size = check_count(batch_size, "batch_size", 1)
    if batch_size > n:
        raise ValueError(
            f"batch_size {batch_size} is larger than the number of examples {n}: no full "
            f"batch to train on. Use batch_size <= {n}."
        )
    num = check_count(num, "num", 2)
    steps = check_count(steps, "steps", 1)
    seed = check_count(seed, "seed", 0)
    window = max(1, steps // 10) if window is None else check_count(window, "window", 1)
    if window > steps:
        raise ValueError(f"window {window} is larger than steps {steps}; use window <= steps.")
    tolerance = _check_number(tolerance, "tolerance")
    if steps_per_call is None:
        steps_per_call = _steps_per_call(data, batch_size, steps)
    steps_per_call = min(check_count(steps_per_call, "steps_per_call", 1), steps)
    min_lr, max_lr = _check_number(min_lr, "min_lr"), _check_number(max_lr, "max_lr")
    if not min_lr < max_lr:
        raise ValueError(f"min_lr {min_lr:g} must be smaller than max_lr {max_lr:g}.")
    tx = _injected(optimizer, min_lr)

    rates = np.geomspace(min_lr, max_lr, num)
    population = Population(
        model_fn, tx, loss_fn, seeds=[seed] * num, hyperparams={"learning_rate": list(rates)},
        has_aux=has_aux, wrt=wrt, on_nonfinite="stop",
    )  # fmt: skip
    batches = _trainer_batches(data, n, batch_size, seed, steps)
    with warnings.catch_warnings():
        # A rate that diverges is what a range test looks for: its member is frozen and
        # reported in the result, not warned about.
        warnings.filterwarnings("ignore", r"member \d+: non-finite loss", RuntimeWarning)
        history = population.fit(
            batches, epochs=1, steps_per_call=steps_per_call, progress=progress
        )  # fmt: skip
    losses = np.full((steps, num), np.nan, np.float64)
    trained = np.asarray(history.losses, np.float64).reshape(-1, num)
    losses[: len(trained)] = trained  # fit ends early when every rate has diverged
    # A frozen member's later calls log the loss of its frozen state: the curve ends at
    # its first non-finite loss.
    nonfinite = ~np.isfinite(losses)
    after = np.cumsum(nonfinite, axis=0) > 0
    losses[after] = np.nan
    final = losses[-window:].mean(axis=0)
    start = losses[0]  # the same for every rate: the same weights on the same first batch
    blown = final > start + (DIVERGENCE_FACTOR - 1) * np.abs(start)
    diverged = after.any(axis=0) | ~population.active | blown
    result = LRFinderResult(
        learning_rates=rates, losses=losses, final_losses=final, diverged=diverged,
        window=window, tolerance=tolerance, suggestion=None,
    )  # fmt: skip
    result = dataclasses.replace(result, suggestion=result.suggest())
    edge = _at_an_end(result)
    if edge is not None:
        warnings.warn(edge, UserWarning, stacklevel=2)
    return result


def _at_an_end(result: LRFinderResult) -> str | None:
    """Why a suggestion at either end of the range says little, and what to do."""
    rates, suggestion = result.learning_rates, result.suggestion
    if suggestion is None:
        return None
    kept = ~result.diverged & np.isfinite(result.final_losses)
    lowest = result.final_losses[result.best]
    band = lowest + result.tolerance * abs(lowest)
    if suggestion == rates[0] and kept.all() and (result.final_losses <= band).all():
        return (
            f"every rate from {rates[0]:.3g} to {rates[-1]:.3g} ended within "
            f"{result.tolerance:.0%} of the lowest final loss (the loss started at "
            f"{result.losses[0, 0]:.4g}): the range does not tell the rates apart, so the "
            f"suggestion {suggestion:.3g} is only the smallest rate tried. If the losses "
            f"barely moved, these rates are too small to train anything in "
            f"{result.losses.shape[0]} steps: widen the range upward (raise max_lr) or "
            f"train more steps."
        )
    if suggestion == rates[0]:
        return (
            f"the suggestion {suggestion:.3g} is the smallest rate tried: a smaller rate "
            f"may train as well, and more safely. Widen the range: lower min_lr."
        )
    if suggestion == rates[-1]:
        return (
            f"the suggestion {suggestion:.3g} is the largest rate tried: a larger rate may "
            f"train better still. Widen the range: raise max_lr (past where rates diverge)."
        )
    return None


def _trainer_batches(data: Any, n: int, batch_size: int, seed: int, steps: int) -> Callable:
    """The batches ``Trainer.fit(data, batch_size=, seed=)`` trains on, epoch after epoch
    (``epoch_order(seed, epoch, n)``, short final batch dropped), cut at ``steps``: a
    stream, so the run is exactly ``steps`` long whatever the epoch length."""
    host = jax.tree.map(np.asarray, data)
    per_epoch = n // batch_size

    def batches() -> Iterator[Any]:
        for step in range(steps):
            epoch, index = divmod(step, per_epoch)
            if index == 0:
                order = np.asarray(epoch_order(seed, epoch, n))
            rows = order[index * batch_size : (index + 1) * batch_size]
            yield jax.tree.map(lambda x, rows=rows: x[rows], host)

    return batches


def _steps_per_call(data: Any, batch_size: int, steps: int) -> int:
    """All ``steps`` in one compiled call when their batches fit the stream's chunk budget,
    else as few equal calls as fit (a shorter last call compiles once more)."""
    per_batch = sum(
        (np.asarray(x).nbytes // max(1, np.shape(x)[0])) * batch_size for x in jax.tree.leaves(data)
    )
    calls = max(1, math.ceil(steps * per_batch / CHUNK_BYTES))
    return math.ceil(steps / calls)


def _injected(optimizer: Any, rate: float) -> optax.GradientTransformation:
    if not callable(optimizer):
        raise TypeError(
            f"optimizer must be an optax optimizer factory called as "
            f"optimizer(learning_rate=...), such as optax.adam or optax.sgd; got "
            f"{type(optimizer).__name__}. Pass the function, not optax.adam(1e-3)."
        )
    try:
        tx = optax.inject_hyperparams(optimizer)(learning_rate=rate)
    except TypeError as error:
        raise TypeError(
            f"optimizer(learning_rate=...) failed: {error}. Pass an optax optimizer "
            f"factory whose learning rate is its `learning_rate` argument (optax.adam, "
            f"optax.sgd, or lambda learning_rate: optax.chain(..., optax.adam(learning_rate)))."
        ) from None
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            f"optimizer(learning_rate=...) returned {type(tx).__name__}, not an optax "
            f"GradientTransformation."
        )
    return tx


def _check_data(data: Any) -> int:
    if data is None or is_stream(data):
        raise TypeError(
            f"data must be a data set: a pytree of arrays sharing a leading examples axis "
            f"(e.g. {{'x': x, 'y': y}}), got {type(data).__name__}. The finder draws "
            f"Trainer.fit's shuffled batches from it; stack a stream's batches first."
        )
    return check_leading_size(data)


def _check_number(value: Any, name: str) -> float:
    """A positive rate, or a non-negative tolerance."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.number):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}.")
    if name == "tolerance" and not (math.isfinite(value) and value >= 0):
        raise ValueError(f"tolerance must be a non-negative fraction (e.g. 0.1), got {value!r}.")
    if name != "tolerance" and not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}.")
    return float(value)
