"""nnxscan.shell: the imperative shell that owns the user's NNX objects.

It compiles the pure core, writes trained state back into the user's ``nnx.Module`` and
``nnx.Optimizer`` with ``nnx.update``, and owns progress, clocks and the command line.

- :class:`Trainer`: ``fit`` / ``evaluate`` / ``save`` / ``restore`` on your module.
- :func:`scan_train`: one compiled scan over a stack of batches, on your module and
  ``nnx.Optimizer``.
- :class:`Population`: N models (seeds, hyperparameter sweeps) trained in one compiled
  program.
- :class:`FitArguments`: the options ``Trainer.fit`` and ``Population.fit`` share, each
  documented once.
- :class:`History`: what ``fit`` returns (losses, epoch logs, ``plot``).
- :func:`find_learning_rate`: a learning-rate range test, N rates trained side by side
  in one compiled program (:class:`LRFinderResult`: curves, suggestion, ``plot``).
- :class:`Plan`: how the steps are executed (``"scan"``, ``"unrolled"``, ``"step"``).
- :func:`load_model`: a trained model from a checkpoint, into an abstract module
  (``nnx.eval_shape``), for inference.
- :func:`enable_compilation_cache`: keep compiled programs on disk, so a second process
  compiles nothing.
- :class:`Preempted`: what ``fit`` raises after saving on SIGTERM (resume with
  ``fit(..., resume=True)``).
- :class:`NonFiniteLossWarning`: what ``fit`` warns once when steps had a non-finite loss
  under ``on_nonfinite="ignore"``.
- :func:`train_tasks`: continual learning, one task after another, with the accuracy
  matrix that shows what earlier tasks lost.
- :class:`EarlyStopping`, :class:`LambdaCallback`: built-in callbacks (the metric writers
  live in :mod:`nnxscan.adapters.writers`).

Example:
  >>> from nnxscan.shell import Trainer
  >>> history = Trainer(model, optax.adam(1e-3), loss_fn).fit(data, epochs=5, batch_size=32)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and IDEs; at run time each name loads on first use
    from nnxscan.shell._edges.compile_cache import enable_compilation_cache
    from nnxscan.shell._engine.fit import NonFiniteLossWarning, Preempted
    from nnxscan.shell._engine.options import FitArguments
    from nnxscan.shell._engine.plans import Plan
    from nnxscan.shell._scan_train import scan_train
    from nnxscan.shell.callbacks import EarlyStopping, LambdaCallback
    from nnxscan.shell.continual import train_tasks
    from nnxscan.shell.history import History
    from nnxscan.shell.loading import load_model
    from nnxscan.shell.lr_finder import LRFinderResult, find_learning_rate
    from nnxscan.shell.population import Population
    from nnxscan.shell.trainer import Trainer

# Where each public name lives. Importing ``nnxscan.shell`` (or any module in it, such as
# the CLI) loads none of them, so nothing imports jax until a name is used: ``nnxscan
# --help`` answers before jax would have finished importing (PEP 562).
_PUBLIC = {
    "EarlyStopping": "nnxscan.shell.callbacks",
    "FitArguments": "nnxscan.shell._engine.options",
    "History": "nnxscan.shell.history",
    "LRFinderResult": "nnxscan.shell.lr_finder",
    "LambdaCallback": "nnxscan.shell.callbacks",
    "NonFiniteLossWarning": "nnxscan.shell._engine.fit",
    "Plan": "nnxscan.shell._engine.plans",
    "Population": "nnxscan.shell.population",
    "Preempted": "nnxscan.shell._engine.fit",
    "Trainer": "nnxscan.shell.trainer",
    "enable_compilation_cache": "nnxscan.shell._edges.compile_cache",
    "find_learning_rate": "nnxscan.shell.lr_finder",
    "load_model": "nnxscan.shell.loading",
    "scan_train": "nnxscan.shell._scan_train",
    "train_tasks": "nnxscan.shell.continual",
}

__all__ = [
    "EarlyStopping",
    "FitArguments",
    "History",
    "LRFinderResult",
    "LambdaCallback",
    "NonFiniteLossWarning",
    "Plan",
    "Population",
    "Preempted",
    "Trainer",
    "enable_compilation_cache",
    "find_learning_rate",
    "load_model",
    "scan_train",
    "train_tasks",
]


def __getattr__(name: str) -> Any:
    """Imports a public name's module on first use and keeps the name here (PEP 562)."""
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
