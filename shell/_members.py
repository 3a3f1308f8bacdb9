"""The owner of a population's stacked state: its buffers, counters and frozen members.

A population writes to no user object: ``member(i)`` hands out fresh modules. So this
owner keeps the stacked ``(state, opt_state)`` as a flat list of (donated) buffers, the
epoch and step counters, and which members still train, and it is the one place that
replaces them: after a compiled call, on a restore, on ``load_state``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax
import numpy as np
from flax import nnx

from nnxscan.pure.population import member_state, select_members
from nnxscan.shell._calls import held_interrupts
from nnxscan.shell._placement import Placement


class Members:
    """The stacked carry of N members, placed by ``placement``, and what goes with it."""

    def __init__(self, graphdef: nnx.GraphDef, state: Any, opt_state: Any, placement: Placement):
        self.graphdef, self.placement = graphdef, placement
        leaves, self.carry_def = jax.tree.flatten((state, opt_state))
        self.leaves = placement.put_carry(leaves)
        self.size = int(jax.tree.leaves(state)[0].shape[0])
        self.epoch = 0
        self.step = 0
        self.active = np.ones((self.size,), bool)
        # The run so far as JSON (from the last restore), for a resumed fit's History.
        self.restored_run = ""
        # Whether load_state replaced the state since the last checkpoint was written.
        self.loaded_since_checkpoint = False

    def carry(self) -> tuple[Any, Any]:
        """``(state, opt_state)`` stacked, in the owner's buffers (the next call donates
        them: :meth:`copy_of` for something to keep)."""
        return jax.tree.unflatten(self.carry_def, self.leaves)

    def copy_of(self, which: int) -> Any:
        """A copy of the stacked state (``which=0``) or optax state (``1``) alone."""
        part = self.carry()[which]
        return jax.tree.map(lambda x: x.copy(), part)

    def member(self, index: int) -> Any:
        """Member ``index``'s model state on one device (the default one), in new buffers:
        a module built from it trains with a plain ``Trainer``, mesh or not."""
        state = _take_member(self.carry()[0], index)
        if self.placement.mesh is not None:
            state = jax.device_put(state, jax.devices()[0])
        return state

    @contextmanager
    def call(self) -> Iterator[Callable[[list], None]]:
        """Yields ``keep(new_leaves)`` for one compiled call; a Ctrl-C while it runs is
        raised after the result is kept, so the owner never holds donated buffers."""
        with held_interrupts() as interrupted:
            yield self._keep
        if interrupted():
            raise KeyboardInterrupt

    def _keep(self, leaves: list) -> None:
        self.leaves = list(leaves)

    def load_state(self, state: Any, where: Any = None) -> None:
        """Replaces the members' model state (all of them, or those ``where`` is True);
        the optax state stays."""
        current, opt_state = self.carry()
        if jax.tree.structure(state) != jax.tree.structure(current):
            raise ValueError(
                "load_state needs a stacked state of this population's structure (e.g. "
                "population.state); the one given differs."
            )
        for new, old in zip(jax.tree.leaves(state), jax.tree.leaves(current), strict=True):
            if new.shape != old.shape or new.dtype != old.dtype:
                raise ValueError(
                    f"load_state: a leaf of shape {new.shape} {new.dtype} where the "
                    f"population holds {old.shape} {old.dtype}."
                )
        if where is not None:
            state = select_members(np.asarray(where, bool), state, current)
        leaves = jax.tree.leaves((state, opt_state))
        self.leaves = self.placement.put_carry([x.copy() for x in leaves])
        self.loaded_since_checkpoint = True

    def checkpoint_tree(
        self, seeds: tuple[int, ...], run: str = "", shared_order: bool = False
    ) -> dict[str, Any]:
        state, opt_state = self.carry()
        meta = {
            "epoch": self.epoch,
            "step": self.step,
            "seeds": np.asarray(seeds, np.int64),
            "active": self.active.copy(),
            "shared_order": bool(shared_order),
            "run": run,
        }
        return {"state": state, "opt_state": opt_state, "meta": meta}

    def restore(self, tree: dict[str, Any]) -> None:
        """Takes a restored :meth:`checkpoint_tree` (already checked by the caller)."""
        leaves = jax.tree.leaves((tree["state"], tree["opt_state"]))
        self.leaves = self.placement.put_carry(leaves)
        meta = tree["meta"]
        self.epoch, self.step = int(meta["epoch"]), int(meta["step"])
        self.active = np.asarray(meta["active"], bool).copy()
        self.restored_run = str(meta["run"])
        self.loaded_since_checkpoint = False


# One program per state structure: the index is an argument, not a constant (slicing each
# leaf eagerly would compile a slice per leaf shape).
_take_member = jax.jit(member_state)
