"""Whether a metric is minimized or maximized, read off its name (``mode="auto"``)."""

from __future__ import annotations

import re

# Keras decides "auto" from the metric object's direction; nnxscan's metrics are plain dict
# keys, so the direction is read off the name's words instead. Together these cover the
# name of every Keras built-in metric (each maps to the direction Keras gives it).
_MAX_WORDS = frozenset(
    {"acc", "accuracy", "auc", "precision", "recall", "sensitivity", "specificity", "f1",
     "fbeta", "iou", "r2", "correlation", "similarity"}
)  # fmt: skip
_MIN_WORDS = frozenset(
    {"loss", "error", "mse", "mae", "mape", "msle", "rmse", "hinge", "crossentropy", "bce",
     "xent", "nll", "divergence", "kld", "poisson", "logcosh", "perplexity"}
)  # fmt: skip


def metric_direction(name: str) -> str | None:
    """``"max"``, ``"min"`` or None (undecided) for a log key, as ``mode="auto"`` reads it
    (``EarlyStopping``, ``Population.best``).

    Example:
      >>> metric_direction("eval_accuracy"), metric_direction("val_loss"), metric_direction("x")
      ('max', 'min', None)
    """
    words = set(re.split(r"[^a-z0-9]+", name.lower().removeprefix("eval_")))
    up = bool(words & _MAX_WORDS) or any(w.endswith(("acc", "accuracy")) for w in words)
    down = bool(words & _MIN_WORDS)
    if up == down:  # neither, or both ("acc_loss"): the user has to say
        return None
    return "max" if up else "min"
