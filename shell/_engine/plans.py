"""Execution plans: how the shell runs a stretch of training steps.

Three plans:

- ``"scan"``: one ``lax.scan`` over every step of the epoch, one compiled call per epoch.
- ``"unrolled"``: chunks of ``steps_per_call`` steps (default 4), fully unrolled (no while
  loop left), one compiled call per chunk.
- ``"step"``: one compiled step per call, dispatched asynchronously, no per-step host sync.

The ``"auto"`` rule is deterministic (every process picks the same plan): ``"scan"``, with
consecutive epochs fused when nothing needs the host between them, for every backend and
model: it minimizes the whole run, compile included. CNNs on the CPU scan too, as the
compiled programs rewrite convolutions into the dimension order XLA:CPU gives only an
entry computation (jax#12868; :func:`nnxscan.pure.canonical_conv_dimensions`). Unrolled
chunks compile several times longer for the same per-step speed. A short run does not
pick ``"step"`` either: its per-step program compiles faster but runs its steps slower,
and measured over short runs of five workloads it won steadily on none (a plan that
changed with the epoch count would also break ``fit(2)`` + ``fit(2)`` being bitwise
``fit(4)``). Measurements: ``docs/performance.md``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from nnxscan.pure.checks import abstract_batch, check_count

# Chunks of 4 unrolled steps measured best for the NNX MNIST tutorial CNN, against 8 and
# one step a call (docs/performance.md).
UNROLLED_STEPS_PER_CALL = 4
_KINDS = ("scan", "unrolled", "step")
# Host callbacks can fail inside a compiled call, after its inputs were donated.
CALLBACK_PRIMITIVES = frozenset({"debug_callback", "io_callback", "pure_callback"})


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
    """Turns the user's ``execution=`` into a Plan; ``None`` for ``"auto"``."""
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
    if plan.steps_per_call is not None:
        plan = plan._replace(steps_per_call=check_count(plan.steps_per_call, "steps_per_call", 1))
    if plan.kind == "step" and plan.steps_per_call != 1:
        raise ValueError("Plan('step') runs one step per call; use Plan('unrolled', k) for k.")
    return plan


class StepTraits(NamedTuple):
    """What the shell knows about a traced step before training: for the plan rule and
    donation."""

    has_convolution: bool
    has_callback: bool


def primitive_names(jaxpr: Any) -> set[str]:
    """Names of every primitive in a (closed) jaxpr and the jaxprs nested in it."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    names |= primitive_names(sub)
    return names


def choose_plan(traits: StepTraits, backend: str) -> Plan:
    """The ``"auto"`` rule: one scan (epochs fused when nothing needs the host between them).

    ``traits`` and ``backend`` are what the rule may read, all known before training; since
    the compiled programs put convolutions in XLA:CPU's canonical layout, neither changes
    the plan (a CNN on the CPU scans as fast as it steps, see ``docs/performance.md``).

    Example:
      >>> choose_plan(step_traits(step, graphdef, state, opt_state, batch), "cpu")
      Plan(kind='scan', steps_per_call=None)
    """
    return Plan("scan")


def step_traits(step: Any, graphdef: Any, state: Any, opt_state: Any, batch: Any) -> StepTraits:
    """Traces (does not compile) a jitted ``step`` on these inputs and reports its traits."""
    jaxpr = jax.make_jaxpr(step)(graphdef, state, opt_state, abstract_batch(batch))
    names = primitive_names(jaxpr)
    return StepTraits(
        has_convolution="conv_general_dilated" in names,
        has_callback=bool(names & CALLBACK_PRIMITIVES),
    )
