"""The one fit engine behind ``Trainer`` and ``Population``.

A front-end checks its own arguments, then hands the engine an owner (``owner.ModelOwner``,
or the members' ``members.StackedOwner``) whose layout (``_engine.layout``) says what differs
between one model and members. Everything else is written once, here and in ``fit``: the
fit-time checks, the plan, the epoch source, evaluation, checkpoints, resume, the budget
(``schedule.Schedule``) and the call to the one ``fit.FitLoop``.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscan.adapters.data import GrainEpochs
from nnxscan.pure.checks import abstract_batch, check_batch_size, check_count
from nnxscan.shell._edges import checkpointing as _checkpointing
from nnxscan.shell._edges.logs import empty_history, empty_losses
from nnxscan.shell._engine.calls import Execution, donates_carry, prepare_execution
from nnxscan.shell._engine.epochs import (
    ArrayEpochs,
    EpochOrders,
    Epochs,
    StepEpochs,
    StreamEpochs,
)
from nnxscan.shell._engine.fit import CallbackList, Checkpoints, FitLoop
from nnxscan.shell._engine.layout import DataKind, Layout
from nnxscan.shell._engine.options import FitOptions
from nnxscan.shell._engine.owner import Owner
from nnxscan.shell._engine.placement import Placement, device_of
from nnxscan.shell._engine.plans import Plan
from nnxscan.shell._engine.programs import TrainProgram
from nnxscan.shell._engine.schedule import Schedule, with_steps_per_call
from nnxscan.shell._engine.streaming import EpochSource, default_chunk_size
from nnxscan.shell.history import History


class Engine:
    """Trains and evaluates what ``owner`` holds.

    Args:
      program: the cached compiled pieces of the step (``programs.train_program``).
      owner: who holds the state (one model, or members stacked).
      placement: one device, or a mesh.
      explicit_plan: the plan the user asked for, or None for ``"auto"``.
      trainer: the object callbacks receive (the Trainer or the Population).
      loss_fn, update_metrics, rngs: what NNX metrics are fed with when an evaluation
        uses them (the front-end's own).
    """

    def __init__(
        self,
        *,
        program: TrainProgram,
        owner: Owner,
        placement: Placement,
        explicit_plan: Plan | None,
        trainer: Any,
        loss_fn: Callable,
        update_metrics: Callable | None = None,
        rngs: Any = None,
    ):
        self.program, self.owner = program, owner
        # As configured; ``placement`` is it bound to the mesh of the call in progress.
        self.configured = self.placement = placement
        self.explicit_plan, self.trainer = explicit_plan, trainer
        self.loss_fn, self.update_metrics, self.rngs = loss_fn, update_metrics, rngs
        self.orders = EpochOrders()  # the next epochs' orders, drawn while the device works

    def bind(self) -> Placement:
        """Resolves the mesh of this call (``mesh=``, else ``jax.set_mesh``'s)."""
        self.placement = self.configured.bound(self.owner.layout)
        return self.placement

    # -- the plan ---------------------------------------------------------------------------

    def run_layout(self, kind: DataKind, member_batches: bool = False) -> Layout:
        """The owner's layout for a fit of data of this kind on this call's mesh."""
        return self.owner.layout.for_run(kind, member_batches, self.placement.member_axis)

    def execution(self, batch: Any, layout: Layout) -> Execution:
        """Traces ONE model's step on the shapes of ``batch`` (one step's, as ``layout`` lays it
        out) with no compile: the plan and whether the carry may be donated."""
        placement = self.placement
        graphdef, state, opt_state = self.owner.read()
        member_axes = len(layout.shape)  # the carry's leading members axes (0 or 1)
        lead = len(layout.data_lead)  # and the batch's

        def abstract_carry() -> tuple[Any, Any]:
            # Built only when the step is traced (the traits are cached per graphdef and
            # batch): flattening and rebuilding an nnx.State costs time on every fit.
            shardings = placement.carry_shardings(state, opt_state)
            leaves, treedef = jax.tree.flatten((state, opt_state))
            if shardings is None:
                shardings = [None] * len(leaves)
            pairs = zip(leaves, shardings, strict=True)
            abstract = [_one_model(x, s, member_axes, member_axes) for x, s in pairs]
            return layout.model_carry(jax.tree.unflatten(treedef, abstract))

        sharding = placement.batch_sharding
        batch = jax.tree.map(lambda x: _one_model(x, sharding, lead, 0), batch)
        donate = donates_carry((state, opt_state))
        return prepare_execution(
            self.program, self.explicit_plan, graphdef, abstract_carry, batch, donate
        )

    def plan_for(self, data: Any, batch_size: int, member_batches: bool = False) -> Plan:
        """The plan ``fit`` uses for this data set and batch size (traces, no compile); for
        ``data=None``, a step that takes no batch's. The data set is checked as ``fit``
        checks it."""
        with self.bind().context():
            if data is None:
                return self.execution(None, self.run_layout("none", member_batches)).plan
            layout = self.run_layout("arrays", member_batches)
            return self.execution(layout.data_shapes(data, batch_size)[1], layout).plan

    def make_runner(self, layout: Layout) -> Callable[..., Any]:
        """``make(carry_def, carry_shardings, donate)``: the compiled runner of a fit laid
        out as ``layout`` (:meth:`run_layout`)."""
        graphdef = self.owner.read()[0]
        batch_sharding = self.placement.batch_sharding_of(layout)

        def make(carry_def: Any, carry_shardings: Any, donate: bool) -> Any:
            return self.program.runner(
                graphdef, carry_def, donate=donate, carry_shardings=carry_shardings,
                batch_sharding=batch_sharding, layout=layout,
            )  # fmt: skip

        return make

    # -- fit --------------------------------------------------------------------------------

    def fit(self, data: Any, options: FitOptions) -> History:
        """Trains ``options.epochs`` more epochs and at most ``options.max_steps`` more steps (both
        the whole run's, with ``resume``)."""
        checkpoints = options.checkpoints
        try:
            if checkpoints is not None:
                # One run per directory, from before a checkpoint is read until the last
                # one is written: a second run on it raises here, having changed nothing.
                checkpoints.lock()
            # Set-up reads the objects several times (checks, the plan's trace, the runner,
            # the first carry): one walk serves them all, released before any callback runs.
            with self.bind().context(), self.owner.reads_held():
                return self._fit(data, options)
        finally:
            if checkpoints is not None:
                checkpoints.close()  # the loop closed it already, unless fit failed before

    def _fit(self, data: Any, options: FitOptions) -> History:
        layout = self.run_layout(options.data_kind, options.member_batches)
        stream = options.data_kind == "stream"
        if options.epochs is None and stream:
            raise ValueError(
                "a stream's epochs have no length known before it is read: pass epochs= "
                "with max_steps= (fit ends at whichever comes first)."
            )
        owner, whole_run = self.owner, options.resume is not False
        # The last change to the objects before training.
        run = self._resume(options, data) if whole_run else {}
        run.setdefault("history", empty_history(layout))
        schedule = Schedule.of(options.epochs, options.max_steps, whole_run=whole_run,
                               at=(owner.epoch, owner.epoch_step, owner.step))  # fmt: skip
        # An epoch whose steps all ran before a preemption, but not its end (evaluation,
        # hooks), is ended even when the budget is spent: known once its length is.
        unended = owner.epoch_step > 0 and not stream
        if schedule.spent(owner.epoch, owner.step) and not unended:  # nothing left to train
            if options.checkpoints is not None and "partial" in run:  # restored: no new save,
                # but the state/ item a killed run left out of that checkpoint is added.
                options.checkpoints.save(run["history"], empty_losses(owner.layout))
            return _finished(**run)
        if options.data_kind == "none":
            epoch_calls, execution = self._steps(options, layout)
        elif stream:
            epochs = schedule.end_epoch - owner.epoch  # a stream's end_epoch is known
            epoch_calls, execution = self._stream(data, epochs, options, layout)
        else:
            epoch_calls, execution = self._arrays(data, options, layout, schedule.end_epoch)
        execution = execution._replace(  # a data set's (a stream's chunks are its own)
            plan=with_steps_per_call(execution.plan, options.steps_per_call)
        )
        if schedule.spent(owner.epoch, owner.step) and (
            owner.epoch_step != epoch_calls.steps_per_epoch
        ):
            return _finished(**run)
        owner.begin_run(options.run_keys)  # every input is known good now
        loop = FitLoop(
            program=self.program, execution=execution, owner=owner, layout=layout,
            placement=self.placement, make_runner=self.make_runner(layout),
            callbacks=CallbackList(options.callbacks, self.trainer), progress=options.progress,
            progress_logs=options.progress_logs,
            evaluation=options.evaluation, checkpoints=options.checkpoints,
        )  # fmt: skip
        return loop.run(schedule, epoch_calls, **run)

    def _arrays(
        self, data, options: FitOptions, layout: Layout, end_epoch: int | None = None
    ) -> tuple[Epochs, Execution]:
        if options.batch_size is None:
            raise ValueError("batch_size is required when data is a data set of arrays.")
        n, batch = layout.data_shapes(data, options.batch_size)
        batch_size = check_batch_size(options.batch_size, n, drop_remainder=options.drop_remainder)
        self.placement.check_batch_size(batch_size)
        if not options.drop_remainder:
            self.placement.check_batch_size(n % batch_size or batch_size)
        state = self.owner.read()[1]
        data = self.placement.put_data(data, state)
        execution = self.execution(batch, layout)
        epoch_calls = ArrayEpochs(
            data, functools.partial(self.placement.put_data, device=device_of(state)),
            num_examples=n, batch_size=batch_size, seeds=self.owner.run_seeds(options.run_keys),
            shuffle=options.shuffle,
            keep_tail=not options.drop_remainder and n % batch_size > 0, orders=self.orders,
            layout=layout, end_epoch=end_epoch,
        )  # fmt: skip
        return epoch_calls, execution

    def _steps(self, options: FitOptions, layout: Layout) -> tuple[Epochs, Execution]:
        """Epochs of ``steps_per_epoch`` steps of a step that takes no batch (``None``)."""
        put = functools.partial(self.placement.put_data, device=device_of(self.owner.read()[1]))
        return StepEpochs(options.steps_per_epoch, put), self.execution(None, layout)

    def _stream(self, data, epochs: int, options: FitOptions, layout: Layout):
        source = EpochSource(data, epochs)
        state = self.owner.read()[1]
        first, first_epoch = source.peek()
        # Each process streams its own share of every batch: check the local size.
        examples = jax.tree.leaves(layout.first_batch(first))[0].shape[0]
        self.placement.check_batch_size(examples, local=True)
        execution = self.execution(abstract_batch(first), layout)
        epoch_calls = StreamEpochs(
            source, first_epoch, execution.plan,
            chunk_size=options.steps_per_call or default_chunk_size(first),
            put=functools.partial(self.placement.put_chunk, device=device_of(state), layout=layout),
            batch_size=options.batch_size, drop_remainder=options.drop_remainder,
            tail_divisor=self.placement.local_data_parallel(), prefetch=options.prefetch,
            batch_lead=layout.data_lead,
        )  # fmt: skip
        return epoch_calls, execution

    def _resume(self, options: FitOptions, data: Any) -> dict[str, Any]:
        """Restores the newest good checkpoint (or the one ``resume`` names), if any;
        returns the run so far (``FitLoop.run``'s keywords)."""
        run = {}
        directory = options.checkpoint_dir
        step = None if options.resume is True else options.resume
        if step is not None or _checkpointing.latest_step(directory) is not None:
            placement = self.bind()  # onto the model's current shardings, as restore()
            history, partial, where, partial_aux = _checkpointing.resume(
                self.owner, placement, directory, options.run_keys, step
            )
            options.checkpoints.run_log.resumed(history, partial, where)
            run = {"history": history, "partial": partial, "partial_aux": partial_aux}
        if isinstance(data, GrainEpochs):
            data.epoch = self.owner.epoch  # grain draws each epoch's order from its index
        return run

    # -- checkpoints ------------------------------------------------------------------------

    def checkpoints(
        self,
        directory: Any,
        every: Any,
        every_steps: Any,
        resume: bool | int,
        asynchronous: bool = True,
    ) -> tuple[pathlib.Path | None, Checkpoints | None]:
        """Checks fit's checkpoint arguments; returns the directory and when to save (one
        checkpointer for the fit, asynchronous unless asked otherwise; nothing touches the disk
        before the first save)."""
        every = check_count(every, "checkpoint_every", 1)
        if every_steps is not None:
            every_steps = check_count(every_steps, "checkpoint_every_steps", 1)
        if directory is None:
            if resume is not False or every_steps is not None:
                raise ValueError(
                    "resume=True and checkpoint_every_steps need a checkpoint_dir to save "
                    "to and resume from."
                )
            return None, None
        directory = pathlib.Path(directory).resolve()
        _checkpointing.check_directory(directory)  # a file, or not writable: before compiling
        checkpointer = _checkpointing.open_checkpointer(directory, asynchronous=asynchronous)
        # The History goes to the run log beside the checkpoints, a line per save; the
        # checkpoint records where (its cost does not grow with the run).
        run_log = _checkpointing.RunLog(checkpointer)

        def save(history: History, partial: np.ndarray, carry: tuple | None = None,
                 partial_aux: dict[str, np.ndarray] | None = None,
                 at: dict[str, int] | None = None) -> None:  # fmt: skip
            owner = self.owner
            step = owner.step if at is None else at["step"]
            if checkpointer.newest_step() == step and not owner.loaded_since_checkpoint:
                # This step is saved (save_with would keep it): no log line either; a
                # state/ item a killed run left out is added as the checkpointer closes.
                checkpointer.keep_item(step, lambda: owner.checkpoint_tree("", carry))
                return
            run = run_log.record(history, partial, partial_aux)
            _checkpointing.save_with(checkpointer, owner, run, carry, at)

        # Fused epochs' saves are written from host copies of the states: own files only.
        keep = checkpointer.max_to_keep if checkpointer.storage == "auto" else 0
        return directory, Checkpoints(
            every, every_steps, save, checkpointer.close, run_log, checkpointer.lock, keep,
            checkpointer.together,
        )  # fmt: skip


def _one_model(x: Any, sharding: Any, axes: int, spec_axes: int) -> Any:
    """The shape (and, on a mesh, sharding) of ONE model's leaf: a population's leaves lose their
    ``axes`` leading members axes (and ``spec_axes`` entries of the sharding)."""
    shape = tuple(np.shape(x))[axes:]
    dtype = jax.numpy.result_type(x) if not hasattr(x, "dtype") else x.dtype
    weak = bool(getattr(x, "weak_type", False))
    if sharding is None:
        return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak)
    spec = tuple(sharding.spec)[spec_axes:][: len(shape)]
    return jax.ShapeDtypeStruct(
        shape, dtype, sharding=NamedSharding(sharding.mesh, P(*spec)), weak_type=weak
    )


def _finished(history: History, partial: Any = None, partial_aux: Any = None) -> History:
    """The History of a fit with nothing left to train (a resumed run's so far); a run that
    ``max_steps`` ended inside an epoch keeps that epoch's losses (its logs were never written)."""
    if partial is not None and len(partial):
        history.losses = np.concatenate([history.losses, partial])
    return history
