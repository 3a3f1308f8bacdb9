"""A training step as a value: ``Step(init, update, has_aux)``, in optax's manner.

optax bundles an optimizer as a NamedTuple of two pure functions (``init``, ``update``);
nnxscan bundles a training step the same way, so any loop (``scan_steps``, ``make_epoch``,
your own ``lax.scan``, the shell) can run any step: the one :func:`make_train_step` builds
from a loss, or one you write (two optimizers, EMA weights, an environment in the carry).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from flax import nnx

__all__ = ["Step"]

InitFn = Callable[[nnx.GraphDef, nnx.State], Any]
UpdateFn = Callable[[nnx.GraphDef, nnx.State, Any, Any], tuple[nnx.State, Any, Any]]


class Step(NamedTuple):
    """A pure training step: ``init`` builds what the step carries besides the model,
    ``update`` trains one batch.

    Attributes:
      init: ``init(graphdef, state) -> opt_state``, with ``graphdef, state =
        nnx.split(model)``. ``opt_state`` is any pytree: one or several optax states, EMA
        weights, counters, an environment's state.
      update: ``update(graphdef, state, opt_state, batch) -> (state, opt_state, loss)``,
        or ``-> (state, opt_state, (loss, aux))`` with ``has_aux``. Pure: it works under
        ``jax.jit``, ``lax.scan``, ``vmap`` and ``grad``.
      has_aux: whether ``update`` reports ``(loss, aux)``.

    Calling a ``Step`` runs ``update``, so a ``Step`` goes wherever a step function goes
    (``scan_steps``, ``make_epoch``, ``halt_after_nonfinite``). Like an optax transform it is
    hashable by its functions' identities: pass it to a jitted function as a static
    argument. To jit the step alone, jit ``step.update`` (``jax.jit`` keeps a weak reference
    to the function it wraps, which a tuple does not allow).

    Example:
      >>> def init(graphdef, state):
      ...     return init_opt_state(tx, state)
      >>> def update(graphdef, state, opt_state, batch):
      ...     model = nnx.merge(graphdef, state)
      ...     ...  # anything pure
      ...     return nnx.state(model), opt_state, loss
      >>> step = Step(init, update)
      >>> opt_state = step.init(graphdef, state)
      >>> state, opt_state, loss = step(graphdef, state, opt_state, batch)
    """

    init: InitFn
    update: UpdateFn
    has_aux: bool = False

    def __call__(self, graphdef: nnx.GraphDef, state: nnx.State, opt_state: Any, batch: Any):
        """Runs :attr:`update`."""
        return self.update(graphdef, state, opt_state, batch)
