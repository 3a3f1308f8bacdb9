"""Running a plan's compiled calls while keeping the user's objects live.

State buffers are donated to every compiled call, so the arrays the user's module held
before the call are deleted when it runs. The module is therefore written back with the
newest state after each call (the per-step plan: after the stretch of calls, to spare
per-step Python) and, whatever stops the loop (an exception, a KeyboardInterrupt), before the
exception leaves: no user object ever keeps a donated buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from nnxscan.shell.plans import Plan
from nnxscan.shell.programs import TrainProgram

__all__ = ["LiveState", "run_plan"]


class LiveState:
    """The newest ``(state, opt_state)``, kept as flat leaves, and how to write it back.

    ``write(state, opt_state, steps)`` receives the number of steps trained since the last
    write (to advance step counters).
    """

    def __init__(
        self, state: nnx.State, opt_state: Any, write: Callable[[nnx.State, Any, int], None]
    ):
        self.leaves, self.treedef = jax.tree.flatten((state, opt_state))
        self._write = write
        self.unwritten_steps = 0

    def advance(self, leaves: list, steps: int) -> None:
        self.leaves = leaves
        self.unwritten_steps += steps

    def flush(self) -> None:
        if self.unwritten_steps:
            steps, self.unwritten_steps = self.unwritten_steps, 0
            state, opt_state = jax.tree.unflatten(self.treedef, self.leaves)
            self._write(state, opt_state, steps)


def run_plan(
    program: TrainProgram,
    plan: Plan,
    graphdef: nnx.GraphDef,
    live: LiveState,
    data: Any,
    indices: Any,
    num_steps: int,
    on_call: Callable[[], None] | None = None,
) -> list[Any]:
    """Trains ``num_steps`` steps in the plan's chunks; returns each call's stacked outputs.

    Batches are ``data`` gathered by ``indices[step]``. The user's objects hold the final
    state when this returns, and the last completed state when it raises.
    """
    write_each_call = plan.kind != "step"
    run = program.runner(graphdef, live.treedef)
    outs = []
    try:
        for start, length in plan.chunks(num_steps):
            leaves, out = run(live.leaves, data, indices, start, length=length, unroll=plan.unroll)
            live.advance(leaves, length)
            outs.append(out)
            if write_each_call:
                live.flush()
            if on_call is not None:
                on_call()
    finally:
        live.flush()
    return outs
