"""The reference of tests/test_sam.py: the experiment of optax's SAM notebook
(``examples/contrib/sam.ipynb``), written here from its description, not copied.

The notebook minimizes a 2-D loss with two minima, a sharp one at (0, 0) and a flat one at
(2, 0), from (-0.4, -0.4), with three drop-in SAM optimizers built by ``optax.contrib.sam``
(SGD lr 0.01 with a normalized SGD adversary of rho 0.1, sync period 2; the same with
momentum 0.9; Adam lr 0.01 with a normalized Adam adversary of rho 0.03, sync period 5) and
their plain counterparts. Each step is the plain optax loop of optax's documentation: the
loss and its gradient at the parameters, then ``opt.update(grads, state, params)`` (in
opaque mode with ``grad_fn``, the gradient at given parameters) and ``apply_updates``,
jitted, one Python loop step at a time. Those settings are the notebook's; the code is ours.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax import contrib


def loss(params: jax.Array) -> jax.Array:
    """Two minima: a sharp one at (0, 0), a flat one at (2, 0)."""
    x, y = params
    return -jnp.exp(-((x - 2) ** 2) - y**2) - jnp.exp(-(x**2 + 100 * y**2))


class Store(NamedTuple):
    """The parameters, the optimizer state and the step count, carried by a step."""

    params: Any
    state: Any
    step: int = 0


def optimizers(opaque: bool) -> dict[str, optax.GradientTransformation]:
    """The notebook's SAM optimizers (and their plain counterparts), by name."""

    def sam(outer, adversary_lr, adversary, sync_period):
        adversarial = optax.chain(contrib.normalize(), adversary(adversary_lr))
        return contrib.sam(outer, adversarial, sync_period=sync_period, opaque_mode=opaque)

    lr = 0.01
    return {
        "sam": sam(optax.sgd(lr), 0.1, optax.sgd, 2),
        "sgd": optax.sgd(lr),
        "sam_mom": sam(optax.sgd(lr, momentum=0.9), 0.1, optax.sgd, 2),
        "mom": optax.sgd(lr, momentum=0.9),
        "sam_adam": sam(optax.adam(lr), 0.03, optax.adam, 5),
        "adam": optax.adam(lr),
    }


def make_step(opt: optax.GradientTransformation, opaque: bool):
    """One jitted step of the plain optax loop; a SAM state in opaque mode gets
    ``grad_fn``, the loss's gradient at the parameters it is given."""

    @jax.jit
    def step(store: Store) -> tuple[Store, jax.Array]:
        value, grads = jax.value_and_grad(loss)(store.params)
        extra = {}
        if opaque and isinstance(store.state, contrib.SAMState):
            extra["grad_fn"] = jax.grad(lambda p, _: loss(p))
        updates, state = opt.update(grads, store.state, store.params, **extra)
        params = optax.apply_updates(store.params, updates)
        return Store(params, state, store.step + 1), value

    return step


def run(mode: str, steps: int) -> dict[str, Any]:
    """The experiment of ``mode`` ("transparent" or "opaque") for ``steps`` steps, as a
    namespace: ``loss``, ``Store``, ``params`` (the start), and per optimizer name
    ``<name>_opt``, ``<name>_step``, ``<name>_store`` (the last), ``<name>_vals`` and
    ``<name>_params`` (per step)."""
    opaque = mode == "opaque"
    params = jnp.array([-0.4, -0.4])
    namespace: dict[str, Any] = {"loss": loss, "Store": Store, "params": params}
    for name, opt in optimizers(opaque).items():
        step = make_step(opt, opaque)
        store, values, trail = Store(params, opt.init(params)), [], []
        for _ in range(steps):
            store, value = step(store)
            values.append(value)
            trail.append(store.params)
        namespace.update({f"{name}_opt": opt, f"{name}_step": step, f"{name}_store": store,
                          f"{name}_vals": values, f"{name}_params": trail})  # fmt: skip
    return namespace
