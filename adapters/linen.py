"""Edge to Flax Linen: a Linen module as an NNX module whose train/eval mode NNX can switch.

``nnx.bridge.ToNNX`` already runs a Linen module inside NNX, and training it through nnxscan
is exact. What it cannot do is follow NNX's mode switches: a Linen module takes its mode as
a call argument (``train=True``) and needs ``mutable=["batch_stats"]`` to move its batch
statistics, while ``model.eval()``, ``nnx.view(model, deterministic=True)`` and
``Trainer.evaluate`` switch modes by setting the ``deterministic`` attribute of every
submodule. :class:`LinenModule` bridges the two: it holds the ``ToNNX`` module and a
``deterministic`` attribute, and passes ``train=not deterministic`` and the mutable
collections on every call. Loss and metric functions then call ``model(x)`` as for any NNX
module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from flax.nnx import bridge
from flax.nnx.variablelib import variable_name_from_type

__all__ = ["LinenModule"]


class LinenModule(nnx.Module):
    """A Linen module, initialized, as an NNX module that ``model.eval()`` switches.

    Args:
      module: the Linen module (``flax.linen.Module``).
      *sample_args: example inputs for the shape-based initialization
        (``nnx.bridge.lazy_init``), called with ``train=False``.
      rngs: ``nnx.Rngs`` with a ``params`` or default stream for the initialization and,
        for Dropout, a ``dropout`` stream (each call draws a fresh key from every stream,
        exactly as ``nnx.bridge.ToNNX`` does).
      train_arg: the name of the Linen module's mode argument (``train``); ``None`` for a
        module without one. It receives ``not self.deterministic``.
      mutable: the collections a training call updates (``("batch_stats",)``); collections
        the module does not have are left out. Evaluation calls update nothing.
      **sample_kwargs: more example keyword arguments for the initialization.

    Example:
      >>> model = LinenModule(LinenCNN(), x[:1], rngs=nnx.Rngs(0, dropout=1))
      >>> trainer = Trainer(model, optax.adam(1e-3), lambda m, b: xent(m(b["x"]), b["y"]))
      >>> trainer.evaluate(test, accuracy, batch_size=256)   # eval mode: train=False
    """

    def __init__(
        self,
        module: Any,
        *sample_args: Any,
        rngs: nnx.Rngs,
        train_arg: str | None = "train",
        mutable: Sequence[str] = ("batch_stats",),
        **sample_kwargs: Any,
    ):
        self.inner = bridge.ToNNX(module, rngs=rngs)
        init_kwargs = dict(sample_kwargs)
        if train_arg is not None:
            init_kwargs[train_arg] = False
        bridge.lazy_init(self.inner, *sample_args, **init_kwargs)
        self.train_arg = train_arg
        self.mutable = tuple(name for name in mutable if name in _collections(self.inner))
        self.deterministic = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the Linen module in the current mode (``train = not deterministic``)."""
        training = not self.deterministic
        if self.train_arg is not None:
            kwargs.setdefault(self.train_arg, training)
        if training and self.mutable:
            return self.inner(*args, mutable=list(self.mutable), **kwargs)
        return self.inner(*args, **kwargs)


def _collections(module: nnx.Module) -> set[str]:
    """The Linen collection names of the module's variables (``params``, ``batch_stats``...)."""
    variables = jax.tree.leaves(
        nnx.state(module, nnx.Not(nnx.RngState)), is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return {variable_name_from_type(type(v)) for v in variables}
