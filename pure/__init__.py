"""nnxscan.pure: the functional core.

Pure functions over ``(graphdef, state, opt_state)`` pytrees that compose with every JAX
transform (jit, scan, fori_loop, vmap, grad). No I/O, no clocks, no global state.

- :class:`Step`: a training step as a value (``init``, ``update``), in optax's manner;
  :func:`nnx_train_step`: a stateful NNX step (Flax's tutorials' ``train_step``) as one.
- :func:`make_train_step`, :func:`init_opt_state`, :func:`split_wrt`: the step of a loss.
- :func:`scan_steps`: many steps over a stack of batches, in one ``lax.scan``;
  :func:`scan_indexed_steps`: over batches taken from a data set by index (the scan under
  ``make_epoch``, ``Trainer.fit`` and ``Population.fit``).
- :func:`make_epoch`, :func:`epoch_order`: an epoch over a data set, ordered as
  ``Trainer.fit`` orders it.
- :func:`make_eval_step`, :func:`make_evaluate`: metric functions averaged over every
  example; :func:`make_evaluate_metrics`: NNX metrics (``nnx.MultiMetric``) over every
  example.
- :func:`all_finite`, :func:`tree_select`, :func:`halt_after_nonfinite`
  (:class:`HaltState`), :func:`skip_nonfinite`: non-finite guards that stay inside the
  compiled loop; each wraps a ``Step`` and returns one.
- :func:`canonical_conv_dimensions`: a step's convolutions in the dimension order XLA:CPU's
  fast kernels take, also inside a ``lax.scan`` (where XLA leaves them slow, jax#12868).
- :mod:`nnxscan.pure.threefry` (``unrolled_threefry``): a function's ``jax.random`` draws
  through JAX's hash unrolled (the same bits; on the CPU compiled and run sooner than JAX's
  loop of it); the steps nnxscan builds apply it on the CPU.
- :func:`vmap_members` (:class:`MembersState`): the step of N members trained side by
  side (a population), from the step of one; :func:`stack_states`,
  :func:`unstack_states`, :func:`with_hyperparams`: their stacked states;
  :func:`member_state`, :func:`select_members`: one member, or members chosen by a mask;
  :func:`hyperparam_names`, :func:`hyperparam_value`: the hyperparameters
  ``optax.inject_hyperparams`` keeps in an optax state.
- :func:`build_compiled`: a module built in one compiled call (its initializers compile
  once, together, not op by op); :func:`compile_once`: a program that runs once compiled
  sooner on the CPU; :func:`paused_gc`: Python's garbage collector paused while a program
  traces.
- :mod:`nnxscan.pure.hyper`: networks run on generated weights.
- :mod:`nnxscan.pure.batching` (orders cut into batches, the full-then-tail rule),
  :mod:`nnxscan.pure.step_node` (the model with its call-time Rngs and NNX metrics) and
  :mod:`nnxscan.pure.checks` (argument checks that raise before compiling): the pieces
  ``Trainer`` and ``Population`` are built from, for your own loop.

Example:
  >>> step = make_train_step(loss_fn, optax.adam(1e-3))
  >>> graphdef, state = nnx.split(model)
  >>> opt_state = init_opt_state(optax.adam(1e-3), state)
  >>> state, opt_state, losses = jax.jit(scan_steps, static_argnums=0)(
  ...     step, graphdef, state, opt_state, batches)
"""

from nnxscan.pure.build import build_compiled, compile_once, paused_gc
from nnxscan.pure.conv_dimensions import canonical_conv_dimensions
from nnxscan.pure.epoch import epoch_order, make_epoch
from nnxscan.pure.evaluation import make_eval_step, make_evaluate, make_evaluate_metrics
from nnxscan.pure.members import MembersState, vmap_members
from nnxscan.pure.nnx_step import nnx_train_step, step_outputs
from nnxscan.pure.nonfinite import (
    HaltState,
    all_finite,
    halt_after_nonfinite,
    skip_nonfinite,
    tree_select,
)
from nnxscan.pure.population import (
    hyperparam_names,
    hyperparam_value,
    member_state,
    select_members,
    stack_states,
    unstack_states,
    with_hyperparams,
)
from nnxscan.pure.scan import scan_indexed_steps, scan_steps
from nnxscan.pure.step import Step
from nnxscan.pure.train_step import init_opt_state, make_train_step, split_wrt

__all__ = [
    "HaltState",
    "MembersState",
    "Step",
    "all_finite",
    "build_compiled",
    "canonical_conv_dimensions",
    "compile_once",
    "epoch_order",
    "halt_after_nonfinite",
    "hyperparam_names",
    "hyperparam_value",
    "init_opt_state",
    "make_epoch",
    "make_eval_step",
    "make_evaluate",
    "make_evaluate_metrics",
    "make_train_step",
    "member_state",
    "nnx_train_step",
    "paused_gc",
    "scan_indexed_steps",
    "scan_steps",
    "select_members",
    "skip_nonfinite",
    "split_wrt",
    "stack_states",
    "step_outputs",
    "tree_select",
    "unstack_states",
    "vmap_members",
    "with_hyperparams",
]
