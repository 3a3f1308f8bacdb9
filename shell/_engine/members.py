"""The owner of a population's members, stacked along a leading axis.

A population writes to no user object: ``member(i)`` hands out fresh modules. So this owner
keeps the members' carry itself, ``(states, MembersState)``: the stacked states and the
state :func:`~nnxscan.pure.vmap_members`' ``init`` built (the members' optax states and
the mask of those that still train, ``active``), with the counters the fit engine reads
through the :class:`~nnxscan.shell._engine.owner.Owner` protocol, their seeds, and what a
restore must match (seeds, hyperparameters, the run's ``shared_order``). Each member's
state is that of its node: the model, or ``(model, rngs, metrics)`` when the population
carries call-time Rngs or NNX metrics.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxscan.pure import (
    MembersState,
    hyperparam_value,
    member_state,
    select_members,
)
from nnxscan.pure.step_node import unpack_step_node
from nnxscan.shell._engine.layout import Members
from nnxscan.shell._engine.owner import (
    WriteBack,
    check_meta_ints,
    counters,
    metric_logs,
    restore_counters,
)
from nnxscan.shell._engine.programs import member_metrics


class StackedOwner:
    """The stacked carry of N members and what goes with it.

    Args:
      graphdef: every member's node graphdef (one architecture).
      model_graphdef: the graphdef of a member's model alone (what ``metric_fn`` sees).
      state: the members' states, stacked.
      members_state: what ``vmap_members(...).init`` built for them: their optax states,
        stacked, and which of them train.
      layout: the members' :class:`~nnxscan.shell._engine.layout.Members` (one per seed).
      seeds: one per member (its initialization and its shuffle).
      hyperparams: ``{name: N values}`` the members were built with (a restore checks them).
      with_rngs, metrics: whether each member's node carries call-time Rngs, and the NNX
        metrics template it carries (or None).
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        state: Any,
        members_state: MembersState,
        *,
        layout: Members,
        model_graphdef: nnx.GraphDef,
        seeds: tuple[int, ...],
        hyperparams: dict[str, tuple],
        with_rngs: bool = False,
        metrics: nnx.Metric | None = None,
    ):
        self.graphdef, self.model_graphdef = graphdef, model_graphdef
        self.seeds, self.hyperparams = seeds, hyperparams
        self.with_rngs, self.metrics = with_rngs, metrics
        self.layout = layout
        self._carry = (state, members_state)
        self.epoch = 0
        self.step = 0
        self.epoch_step = 0
        #: Counts the changes made to the carry between compiled calls (a freeze, a load):
        #: a fit in progress carries on from the owner's carry when it moves.
        self.revision = 0
        #: The order rule of the run in progress (saved; a resume must use the same).
        self.shared_order = False
        self.loaded_since_checkpoint = False
        # How many leading leaves of a member's node state belong to the model itself.
        self._model_leaves = len(jax.tree.leaves(self._model_part(state)))

    # -- reading ----------------------------------------------------------------------------

    def read(self) -> tuple[nnx.GraphDef, Any, Any]:
        """``(graphdef, state, opt_state)``: the stacked carry, in the owner's buffers (the
        next compiled call donates them: :meth:`copy_of` for something to keep)."""
        return self.graphdef, *self._carry

    def read_state(self) -> Any:
        return self._carry[0]

    def reads_held(self) -> contextlib.AbstractContextManager:
        """Reads cost nothing here (the carry is held, not walked): nothing to hold."""
        return contextlib.nullcontext()

    def release_reads(self) -> None:
        pass

    def copy_of(self, which: int) -> Any:
        """A copy of the stacked state (``which=0``) or optax state (``1``)."""
        part = self._carry[0] if which == 0 else self._carry[1].inner
        return jax.tree.map(lambda x: x.copy(), part)

    @property
    def active(self) -> np.ndarray:
        """Which members train: the carry's ``active``, on the host (a copy)."""
        return np.array(jax.device_get(self._carry[1].active), bool)

    def trains(self) -> bool:
        """Whether any member is left to train."""
        return bool(self.active.any())

    def active_logs(self) -> dict[str, Any]:
        """The epoch's ``active`` log: which members train."""
        return {"active": self.active}

    def set_active(self, indices: Any, value: bool) -> None:
        """Freezes (``value=False``) or unfreezes the members ``indices``: writes the
        carry's ``active``, which the next compiled call reads."""
        active = self.active
        active[indices] = value
        state, members_state = self._carry
        self._carry = (state, members_state._replace(active=jnp.asarray(active)))
        self.revision += 1

    def model_state(self) -> Any:
        """The members' stacked MODEL state (their Rngs and metrics left out), a copy."""
        return jax.tree.map(lambda x: x.copy(), self._model_part(self._carry[0]))

    def evaluation_node(
        self, model_only: bool, rngs: Any = None, metrics: Any = None
    ) -> tuple[nnx.GraphDef, Any]:
        """``(graphdef, stacked state)`` an evaluation merges: the models alone (for a
        ``metric_fn``), or the whole nodes (NNX metrics fed by the loss: the members' own
        Rngs and metrics, which ``rngs`` and ``metrics`` are templates of)."""
        if model_only:
            return self.model_graphdef, self._model_part(self._carry[0])
        return self.graphdef, self._carry[0]

    def member(self, index: int) -> nnx.Module:
        """Member ``index`` as a fresh module on one device (new buffers): it trains with a
        plain ``Trainer``, mesh or not."""
        state = _take_member(self._carry[0], index)
        state = jax.device_put(state, jax.devices()[0])
        node = nnx.merge(self.graphdef, state)
        return unpack_step_node(
            node, with_rngs=self.with_rngs, with_metrics=self.metrics is not None
        ).model

    def _model_part(self, state: Any) -> Any:
        """A member's model state: its node's, or the first of ``(model, rngs, metrics)``."""
        return state[0] if self.with_rngs or self.metrics is not None else state

    # -- metrics ----------------------------------------------------------------------------

    def reset_metrics(self) -> None:
        if self.metrics is not None:
            state, opt_state = self._carry
            self._carry = (member_metrics(self.graphdef, self.with_rngs, "reset")(state), opt_state)

    def take_metrics(self) -> dict[str, Any]:
        """Each member's training metrics since the last reset (``(N,)`` arrays), then reset."""
        if self.metrics is None:
            return {}
        computed = member_metrics(self.graphdef, self.with_rngs, "compute")(self._carry[0])
        values = metric_logs(computed, self.metrics, self.layout)
        self.reset_metrics()
        return values

    # -- writing ----------------------------------------------------------------------------

    def make_write_back(self) -> WriteBack:
        def write(leaves: list, treedef: Any, steps: int) -> None:
            self._carry = jax.tree.unflatten(treedef, leaves)
            self.step += steps

        return write

    def load(self, state: Any, where: Any = None) -> None:
        """Replaces the members' MODEL state (all of them, or those where the ``(N,)`` mask
        ``where`` is True) with a stacked one (e.g. an earlier ``population.state``); their
        Rngs, metrics and optax states stay."""
        current = self._model_part(self._carry[0])
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
        leaves, treedef = jax.tree.flatten(self._carry[0])
        new = [x.copy() for x in jax.tree.leaves(state)] + leaves[self._model_leaves :]
        self._carry = (jax.tree.unflatten(treedef, new), self._carry[1])
        self.loaded_since_checkpoint = True
        self.revision += 1

    # -- the run ----------------------------------------------------------------------------

    def run_seeds(self, run_keys: dict[str, Any]) -> tuple[int, ...]:
        """Each member's shuffle seed: its own, or the first member's for a shared order."""
        if run_keys.get("shared_order"):
            return (self.seeds[0],) * len(self.seeds)
        return self.seeds

    def begin_run(self, run_keys: dict[str, Any]) -> None:
        self.shared_order = bool(run_keys.get("shared_order"))

    # -- checkpoints ------------------------------------------------------------------------

    @property
    def restore_hint(self) -> str:
        """What a checkpoint of another shape of population says about this one."""
        return (
            f"this population has {len(self.seeds)} members with seeds {list(self.seeds)}: "
            f"a checkpoint of another number of members or another model does not fit it"
        )

    def checkpoint_tree(self, run: str = "", carry: tuple | None = None) -> dict[str, Any]:
        # The stacked carry is this owner's own already; ``carry``: a fused call's state
        # at an earlier epoch end (the same structure).
        state, members_state = self._carry if carry is None else carry
        meta = {
            **counters(self),
            "seeds": np.asarray(self.seeds, np.int64),
            "active": self.active,
            "shared_order": bool(self.shared_order),
            "run": run,
        }
        return {"state": state, "opt_state": members_state.inner, "meta": meta}

    def restore(self, tree: dict[str, Any], run_keys: dict[str, Any] | None = None) -> None:
        """Takes a restored :meth:`checkpoint_tree` after checking it holds these members
        (seeds and hyperparameters) and, for a resumed fit, the run's ``shared_order``; a
        mismatch raises and changes nothing."""
        meta = tree["meta"]
        check_meta_ints(meta)  # the owners' COUNTERS
        if run_keys is not None and bool(run_keys.get("shared_order")) != meta["shared_order"]:
            raise ValueError(
                f"resume=True with shared_order={bool(run_keys.get('shared_order'))}, but the "
                f"checkpoint's run used shared_order={bool(meta['shared_order'])}: pass the "
                f"same to go on with the same data orders."
            )
        saved = tuple(int(s) for s in np.asarray(meta["seeds"]))
        if saved != self.seeds:
            raise ValueError(
                f"the checkpoint holds a population with seeds {list(saved)}, this one has "
                f"{list(self.seeds)}: build the Population with the seeds it was saved with."
            )
        for name, values in self.hyperparams.items():
            restored = hyperparam_value(tree["opt_state"], name)
            if restored is not None and not np.allclose(restored, values, rtol=1e-6):
                raise ValueError(
                    f"the checkpoint's members have {name}="
                    f"{[float(f'{v:.6g}') for v in np.asarray(restored)]}, this population "
                    f"was built with {list(values)}: build it with the hyperparams it was "
                    f"saved with."
                )
        active = jnp.asarray(np.asarray(meta["active"], bool))
        members_state = self._carry[1]._replace(inner=tree["opt_state"], active=active)
        self._carry = (tree["state"], members_state)
        restore_counters(self, meta)
        self.shared_order = bool(meta["shared_order"])
        self.loaded_since_checkpoint = False
        self.revision += 1


# One program per state structure: the index is an argument, not a constant (slicing each
# leaf eagerly would compile a slice per leaf shape).
_take_member = jax.jit(member_state)
