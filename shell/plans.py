"""Execution plans: how the shell runs a stretch of training steps.

A ``lax.scan`` over the whole epoch is the fastest plan for most models, but on the CPU XLA
runs some ops far slower inside a loop body: the weight-gradient convolution is ~30x slower
in a scan (jax#12868). Three plans cover it:

- ``"scan"``: one ``lax.scan`` over every step of the epoch, one compiled call per epoch.
- ``"unrolled"``: chunks of ``steps_per_call`` steps (default 4), fully unrolled (no while
  loop left), one compiled call per chunk.
- ``"step"``: one compiled step per call, dispatched asynchronously, no per-step host sync.

The ``"auto"`` rule is deterministic (no timing race, so every process picks the same plan):
on the CPU, if the step's jaxpr contains a convolution, pick ``"unrolled"`` with chunks of
4; otherwise (and on GPU/TPU) pick ``"scan"``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

__all__ = ["UNROLLED_STEPS_PER_CALL", "Plan", "choose_plan", "has_convolution", "resolve_plan"]

# Chunks of 4 unrolled steps measured best for the NNX MNIST tutorial CNN on this CPU
# (1.07 ms/step vs 1.48 for 8 and 1.65 for one step per call).
UNROLLED_STEPS_PER_CALL = 4
_KINDS = ("scan", "unrolled", "step")


class Plan(NamedTuple):
    """How to execute training steps.

    Attributes:
      kind: ``"scan"``, ``"unrolled"`` or ``"step"``.
      steps_per_call: steps per compiled call; ``None`` means the whole epoch (``"scan"``).

    Example:
      >>> Trainer(model, tx, loss_fn, execution=Plan("unrolled", 8))
    """

    kind: str
    steps_per_call: int | None = None

    @property
    def unroll(self) -> bool:
        """Whether the scan inside each call is fully unrolled."""
        return self.kind != "scan"

    def chunks(self, num_steps: int) -> list[tuple[int, int]]:
        """``(start, length)`` of each compiled call over ``num_steps`` steps."""
        size = num_steps if self.steps_per_call is None else self.steps_per_call
        size = max(1, min(size, num_steps))
        return [(a, min(size, num_steps - a)) for a in range(0, num_steps, size)]


def resolve_plan(execution: str | Plan) -> Plan | None:
    """Turns the user's ``execution=`` into a Plan; ``None`` for ``"auto"``.

    Raises ValueError on an unknown plan name or a bad ``steps_per_call``.
    """
    if isinstance(execution, Plan):
        plan = execution
    elif execution == "auto":
        return None
    elif execution == "scan":
        plan = Plan("scan")
    elif execution == "unrolled":
        plan = Plan("unrolled", UNROLLED_STEPS_PER_CALL)
    elif execution == "step":
        plan = Plan("step", 1)
    else:
        raise ValueError(
            f"execution={execution!r} is not a plan; use 'auto', 'scan', 'unrolled', 'step' "
            f"or Plan(kind, steps_per_call)."
        )
    if plan.kind not in _KINDS:
        raise ValueError(f"Plan kind {plan.kind!r} is not one of {_KINDS}.")
    if plan.steps_per_call is not None and (
        not isinstance(plan.steps_per_call, int) or plan.steps_per_call < 1
    ):
        raise ValueError(f"steps_per_call must be None or an int >= 1, got {plan.steps_per_call}.")
    if plan.kind == "step" and plan.steps_per_call != 1:
        raise ValueError("Plan('step') runs one step per call; use Plan('unrolled', k) for k.")
    return plan


def has_convolution(jaxpr: Any) -> bool:
    """Whether a (closed) jaxpr or any jaxpr nested in it contains a convolution."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "conv_general_dilated":
            return True
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                is_jaxpr = hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns")
                if is_jaxpr and has_convolution(sub):
                    return True
    return False


def choose_plan(step_jaxpr: Any, backend: str) -> Plan:
    """The ``"auto"`` rule: unrolled chunks for convolutions on the CPU, else one scan.

    Example:
      >>> choose_plan(jax.make_jaxpr(step)(graphdef, state, opt_state, batch), "cpu")
      Plan(kind='scan', steps_per_call=None)
    """
    if backend == "cpu" and has_convolution(step_jaxpr):
        return Plan("unrolled", UNROLLED_STEPS_PER_CALL)
    return Plan("scan")


def plan_for_step(step: Any, graphdef: Any, state: Any, opt_state: Any, batch: Any) -> Plan:
    """Applies :func:`choose_plan` to ``step`` traced (not compiled) on these inputs."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    jaxpr = jax.make_jaxpr(step)(graphdef, state, opt_state, abstract)
    return choose_plan(jaxpr, jax.default_backend())
