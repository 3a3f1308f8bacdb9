"""What a Population gained from the one fit engine, each against an independent reference:
N single-model Trainer runs (equal up to the documented float rounding of a vmapped step),
or an uninterrupted population run (bitwise where both run the same compiled calls or the
same loop body: conftest's ACROSS_PROGRAMS says when)."""

from __future__ import annotations

import inspect
import os
import signal

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.shell import EarlyStopping, LambdaCallback, Population, Preempted, Trainer
from nnxscan.shell._construction import PopulationArguments, TrainerArguments

from conftest import MLP, BNDropout, assert_trees_close, make_data, xent

# One optimizer for every run: the programs are cached by it, so each member's reference
# Trainer and each rerun compiles nothing new (optax transforms hold no state).
TX = optax.adam(1e-2)
BS = 8
SEEDS = [0, 1, 2]
DATA = make_data(60)  # 7 steps an epoch, 4 examples left over


def mlp(rngs: nnx.Rngs) -> nnx.Module:
    return MLP(rngs=rngs)


def bn_dropout(rngs: nnx.Rngs) -> nnx.Module:
    return BNDropout(rngs=rngs)


def assert_members_match(pop, history, trainers_and_histories, rtol=1e-5, atol=1e-6):
    for i, (trainer, alone) in enumerate(trainers_and_histories):
        np.testing.assert_allclose(history.losses[:, i], alone.losses, rtol=rtol, atol=atol)
        assert_trees_close(pop.member(i), trainer.model, rtol=1e-4, atol=1e-6)


def assert_same_population(a, b, exact=True):
    """Every member's state and optax state, bitwise (``exact``) or to rounding."""
    for tree in ("state", "opt_state"):
        assert_trees_close(getattr(a, tree), getattr(b, tree), exact=exact)
    assert (a.step, a.epoch) == (b.step, b.epoch)


def stream_of(data, batch_size=BS):
    n = len(data["x"])
    return [
        {k: v[i : i + batch_size] for k, v in data.items()} for i in range(0, n - batch_size + 1, 4)
    ]


# -- streams --------------------------------------------------------------------------------


@pytest.mark.slow  # over ~5 s on 2 cores: the fast lane's 5 minutes on CI's machine
def test_a_shared_stream_trains_every_member_as_its_own_trainer_on_that_stream():
    batches = stream_of(DATA)  # 14 overlapping batches of 8
    pop = Population(mlp, TX, xent, seeds=SEEDS)
    history = pop.fit(batches, epochs=2, steps_per_call=5, progress=False)
    assert history.losses.shape == (28, 3) and pop.step == 28
    runs = []
    for seed in SEEDS:
        trainer = Trainer(MLP(rngs=nnx.Rngs(seed)), TX, xent)
        runs.append((trainer, trainer.fit(batches, epochs=2, steps_per_call=5, progress=False)))
    assert_members_match(pop, history, runs)


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
def test_per_member_batches_give_member_i_its_own_slice():
    members = [make_data(40, seed=s) for s in (10, 11, 12)]
    stacked = [
        {k: np.stack([m[k][i : i + BS] for m in members]) for k in ("x", "y")}
        for i in range(0, 40, BS)
    ]  # 5 batches of shape (3, 8, ...)
    pop = Population(mlp, TX, xent, seeds=SEEDS)
    history = pop.fit(lambda: iter(stacked), epochs=2, member_batches=True, progress=False)
    runs = []
    for i, seed in enumerate(SEEDS):
        own = [{k: b[k][i] for k in b} for b in stacked]
        trainer = Trainer(MLP(rngs=nnx.Rngs(seed)), TX, xent)
        runs.append((trainer, trainer.fit(own, epochs=2, progress=False)))
    assert_members_match(pop, history, runs)
    # A data set with a leading members axis: member i shuffles and trains its own.
    data = {k: np.stack([m[k] for m in members]) for k in ("x", "y")}
    pop = Population(mlp, TX, xent, seeds=SEEDS)
    history = pop.fit(data, epochs=2, batch_size=BS, member_batches=True, progress=False)
    runs = []
    for i, seed in enumerate(SEEDS):
        trainer = Trainer(MLP(rngs=nnx.Rngs(seed)), TX, xent)
        own = {k: v[i] for k, v in data.items()}
        runs.append((trainer, trainer.fit(own, epochs=2, batch_size=BS, seed=seed, progress=False)))
    assert_members_match(pop, history, runs)
    with pytest.raises(ValueError, match="leading members axis of 3"):
        pop.fit([{k: v[0] for k, v in stacked[0].items()}], epochs=1, member_batches=True)


# -- plans, fusing, accumulation -------------------------------------------------------------


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
def test_steps_per_call_and_fused_epochs_train_bitwise_what_one_call_per_epoch_trains():
    def run(**fit):
        pop = Population(mlp, TX, xent, seeds=SEEDS)
        history = pop.fit(DATA, epochs=4, batch_size=BS, progress=False, **fit)
        return pop, history

    # A hook on every epoch keeps the epochs apart (nothing fused): one call per epoch.
    separate, reference = run(callbacks=[LambdaCallback(on_epoch_end=lambda *a: None)])
    calls = []
    counting = LambdaCallback(on_call_end=lambda pop, logs: calls.append(logs["step"]))
    chunked, chunked_history = run(steps_per_call=3, callbacks=[counting])
    assert calls[:4] == [3, 6, 7, 10]  # calls of 3 steps, cut at each 7-step epoch's end
    fused, fused_history = run()  # no hooks: the 4 epochs run as one compiled call
    # Fused, the epochs' steps are the same loop body (conftest): bitwise. Chunked, the call
    # of 1 step (6 to 7) is no loop at all (XLA inlines a loop of one trip): another program
    # for that step, so to rounding.
    for other, history, exact in ((chunked, chunked_history, False), (fused, fused_history, True)):
        assert_same_population(other, separate, exact=exact)
        np.testing.assert_allclose(history.losses, reference.losses, rtol=1e-6)
        assert [e["epoch"] for e in history.epochs] == [0, 1, 2, 3]


def test_accumulate_equals_each_members_accumulating_trainer():
    pop = Population(mlp, TX, xent, seeds=SEEDS, accumulate=2)
    history = pop.fit(DATA, epochs=2, batch_size=BS, progress=False)
    runs = []
    for seed in SEEDS:
        trainer = Trainer(MLP(rngs=nnx.Rngs(seed)), TX, xent, accumulate=2)
        runs.append(
            (trainer, trainer.fit(DATA, epochs=2, batch_size=BS, seed=seed, progress=False))
        )
    assert_members_match(pop, history, runs)


# -- call-time Rngs and NNX metrics ----------------------------------------------------------


class DropoutMLP(nnx.Module):
    """Dropout drawn from call-time Rngs, as the Flax MNIST tutorial's loss does."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(4, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.3)
        self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x, *, rngs=None):
        return self.l2(self.drop(nnx.relu(self.l1(x)), rngs=rngs))


def loss_with_rngs(model, batch, rngs):
    logits = model(batch["x"], rngs=rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, logits


def update(metrics, loss, logits, batch):
    metrics.update(loss=loss, logits=logits, labels=batch["y"])


def new_metrics():
    return nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))


@pytest.mark.slow
def test_call_time_rngs_and_nnx_metrics_per_member_equal_each_members_trainer():
    rngs = lambda seed: nnx.Rngs(100 + seed)  # noqa: E731  each member its own dropout stream
    pop = Population(
        lambda r: DropoutMLP(rngs=r), TX, loss_with_rngs, seeds=SEEDS,
        has_aux=True, rngs=rngs, metrics=new_metrics(), update_metrics=update,
    )  # fmt: skip
    history = pop.fit(DATA, epochs=2, batch_size=BS, eval_data=DATA, progress=False)
    for i, seed in enumerate(SEEDS):
        trainer = Trainer(
            DropoutMLP(rngs=nnx.Rngs(seed)), TX, loss_with_rngs, has_aux=True,
            rngs=rngs(seed), metrics=new_metrics(), update_metrics=update,
        )  # fmt: skip
        alone = trainer.fit(DATA, epochs=2, batch_size=BS, seed=seed, eval_data=DATA,
                            progress=False)  # fmt: skip
        np.testing.assert_allclose(history.losses[:, i], alone.losses, rtol=1e-5, atol=1e-6)
        for key in ("train_accuracy", "train_loss", "eval_accuracy", "eval_loss"):
            assert history.epochs[-1][key].shape == (3,)
            np.testing.assert_allclose(history.epochs[-1][key][i], alone.epochs[-1][key],
                                       rtol=1e-5, atol=1e-6)  # fmt: skip
        assert_trees_close(pop.member(i), trainer.model, rtol=1e-4, atol=1e-6)
        evaluated = pop.evaluate(DATA, batch_size=16)
        np.testing.assert_allclose(
            evaluated["accuracy"][i], trainer.evaluate(DATA, batch_size=16)["accuracy"], rtol=1e-5
        )


# -- checkpoints, preemption -----------------------------------------------------------------


def make_population():
    return Population(bn_dropout, TX, xent, seeds=SEEDS)


@pytest.fixture(scope="module")
def straight():
    pop = make_population()
    history = pop.fit(DATA, epochs=3, batch_size=BS, steps_per_call=3, progress=False)
    return pop, history


def cut_at(step):
    class Cut(Exception):
        pass

    def maybe_raise(pop, logs):
        if logs["step"] >= step:
            raise Cut(step)

    return Cut, LambdaCallback(on_call_end=maybe_raise)


@pytest.mark.parametrize(
    "cut",
    [pytest.param(4, marks=pytest.mark.slow), pytest.param(10, marks=pytest.mark.slow)],
    ids=["first_epoch", "mid_epoch"],
)
def test_step_checkpoints_resume_mid_epoch_by_rerunning_bitwise(straight, tmp_path, cut):
    reference, ref_history = straight

    def run(callbacks=()):
        pop = make_population()
        history = pop.fit(DATA, epochs=3, batch_size=BS, checkpoint_dir=tmp_path,
                          checkpoint_every_steps=3, resume=True, callbacks=callbacks,
                          progress=False)  # fmt: skip
        return pop, history

    cut_error, callback = cut_at(cut)
    with pytest.raises(cut_error):
        run([callback])
    pop, history = run()
    assert_same_population(pop, reference)  # the same calls (steps 0-3, 3-6, 6-7, ...): bitwise
    np.testing.assert_allclose(history.losses, ref_history.losses, rtol=1e-6)
    assert [e["epoch"] for e in history.epochs] == [0, 1, 2]


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
def test_sigterm_saves_mid_epoch_and_the_rerun_ends_bitwise(straight, tmp_path, default_sigint):
    reference, ref_history = straight
    sent = []

    def preempt(pop, logs):
        if logs["step"] >= 9 and not sent:  # inside epoch 1 (calls end at 3, 6, 7, 10...)
            sent.append(logs["step"])
            os.kill(os.getpid(), signal.SIGTERM)

    first = make_population()
    with pytest.raises(Preempted, match="step 10"):
        first.fit(DATA, epochs=3, batch_size=BS, checkpoint_dir=tmp_path, steps_per_call=3,
                  callbacks=[LambdaCallback(on_call_end=preempt)], progress=False)  # fmt: skip
    assert (first.step, first.epoch) == (10, 1)  # stopped after the call in flight
    again = make_population()
    history = again.fit(DATA, epochs=3, batch_size=BS, checkpoint_dir=tmp_path,
                        steps_per_call=3, resume=True, progress=False)  # fmt: skip
    assert_same_population(again, reference)
    np.testing.assert_allclose(history.losses, ref_history.losses, rtol=1e-6)


# -- one engine, one interface ---------------------------------------------------------------


def test_trainer_and_population_share_names_defaults_and_signatures():
    trainer_fit = inspect.signature(Trainer.fit).parameters
    population_fit = inspect.signature(Population.fit).parameters
    only_trainer = {"seed"}  # a population's seeds are its members'
    only_population = {"shared_order", "member_batches"}
    assert set(trainer_fit) - only_trainer == set(population_fit) - only_population
    # The options both take are declared once (FitArguments) and unknown ones are refused.
    assert trainer_fit["options"].annotation == population_fit["options"].annotation
    assert "FitArguments" in str(trainer_fit["options"].annotation)
    for subject in (
        Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent),
        Population(mlp, TX, xent, seeds=SEEDS),
    ):
        with pytest.raises(TypeError, match=r"'epoch'.*Did you mean 'epochs'"):
            subject.fit({"x": np.zeros((8, 4), np.float32)}, epochs=1, epoch=2)
    for name in set(trainer_fit) & set(population_fit):
        assert trainer_fit[name].default == population_fit[name].default, name
        assert trainer_fit[name].kind == population_fit[name].kind, name
    for method in ("restore", "save", "evaluate"):
        ours = inspect.signature(getattr(Trainer, method)).parameters
        theirs = inspect.signature(getattr(Population, method)).parameters
        for name in set(ours) & set(theirs):
            assert ours[name].default == theirs[name].default, (method, name)
            assert ours[name].kind == theirs[name].kind, (method, name)
    assert (
        inspect.signature(Trainer.restore).parameters["step"].kind == inspect.Parameter.KEYWORD_ONLY
    )
    # Their construction options are declared once too, and refused alike.
    trainer_init = inspect.signature(Trainer.__init__).parameters["options"].annotation
    population_init = inspect.signature(Population.__init__).parameters["options"].annotation
    assert "TrainerArguments" in str(trainer_init)
    assert "PopulationArguments" in str(population_init)
    shared_init = set(TrainerArguments.__annotations__) & set(PopulationArguments.__annotations__)
    assert {"wrt", "has_aux", "execution", "on_nonfinite", "accumulate", "mesh", "data_axis",
            "fsdp_min_size", "rngs", "metrics", "update_metrics"} <= shared_init  # fmt: skip


def test_configuration_the_program_is_built_from_is_read_only():
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    pop = Population(mlp, TX, xent, seeds=SEEDS)
    for subject in (trainer, pop):
        for name in ("loss_fn", "has_aux", "update_metrics", "on_nonfinite", "accumulate"):
            with pytest.raises(AttributeError):
                setattr(subject, name, None)
    assert trainer.num_members is None and pop.num_members == 3


def test_a_one_member_population_is_told_apart_from_a_trainer_by_declaration():
    """EarlyStopping reads num_members: a one-member population freezes its member, a
    Trainer stops; neither guesses from the logs' shapes."""
    stop = EarlyStopping("loss", patience=1, mode="max", verbose=False)  # loss falls: stops
    pop = Population(mlp, TX, xent, seeds=[0])
    history = pop.fit(DATA, epochs=5, batch_size=BS, callbacks=[stop], progress=False)
    assert history.epochs[-1]["loss"].shape == (1,)
    assert isinstance(stop.wait, np.ndarray) and stop.stopped_epoch.tolist() == [1]
    assert pop.active.tolist() == [False] and len(history.epochs) == 2
    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    history = trainer.fit(DATA, epochs=5, batch_size=BS, callbacks=[stop], progress=False)
    assert stop.stopped_epoch == 1 and len(history.epochs) == 2


def per_class_accuracy(model, batch):
    hits = model(batch["x"]).argmax(-1) == batch["y"]
    onehot = batch["y"][:, None] == jnp.arange(3)
    return {
        "accuracy": jnp.mean(hits),
        # Per class: the fraction of the batch that is a hit of that class.
        "hits_per_class": jnp.mean(onehot & hits[:, None], axis=0),
    }


def test_array_metrics_are_averaged_elementwise_and_never_taken_for_members(tmp_path):
    from nnxscan.adapters.writers import CSVWriter, JSONLinesWriter

    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), TX, xent)
    stop = EarlyStopping("eval_accuracy", patience=5, verbose=False)
    writers = [CSVWriter(tmp_path / "logs.csv"), JSONLinesWriter(tmp_path / "logs.jsonl")]
    history = trainer.fit(DATA, epochs=2, batch_size=BS, eval_data=DATA, eval_batch_size=16,
                          metric_fn=per_class_accuracy, callbacks=[stop, *writers],
                          progress=False)  # fmt: skip
    logged = history.epochs[-1]["eval_hits_per_class"]
    # The reference: the per-example hits over all 60 examples, by hand.
    logits = trainer.model(jnp.asarray(DATA["x"]))
    hits = np.asarray(logits.argmax(-1)) == DATA["y"]
    expected = [(hits & (DATA["y"] == c)).mean() for c in range(3)]
    assert isinstance(logged, np.ndarray) and logged.shape == (3,)
    np.testing.assert_allclose(logged, expected, rtol=1e-6)
    np.testing.assert_allclose(logged.sum(), history.epochs[-1]["eval_accuracy"], rtol=1e-6)
    assert stop.best_epoch is not None and not isinstance(stop.wait, np.ndarray)
    header = (tmp_path / "logs.csv").read_text().splitlines()[0].split(",")
    assert {"eval_hits_per_class/0", "eval_hits_per_class/2"} <= set(header)
    bad = EarlyStopping("eval_hits_per_class", mode="max", verbose=False)
    with pytest.raises(ValueError, match=r"array of shape \(3,\)"):
        trainer.fit(DATA, epochs=1, batch_size=BS, eval_data=DATA, metric_fn=per_class_accuracy,
                    callbacks=[bad], progress=False)  # fmt: skip


def test_the_progress_line_shows_the_members_median_and_range(capsys):
    pop = Population(mlp, TX, xent, seeds=SEEDS)
    pop.freeze(1)
    history = pop.fit(DATA, epochs=1, batch_size=BS)  # progress on by default, as Trainer's
    out = capsys.readouterr().out
    loss = history.epochs[0]["loss"]
    assert f"loss median {np.median(loss):.4g}" in out
    assert f"[{loss.min():.4g}, {loss.max():.4g}] of 3 members" in out
    assert "2 of 3 training" in out


def test_population_evaluate_refuses_metrics_its_members_were_not_built_with():
    pop = Population(mlp, TX, xent, seeds=SEEDS)
    metrics = nnx.metrics.Average("loss")
    with pytest.raises(TypeError, match=r"NNX metrics the members were built with"):
        pop.evaluate(DATA, batch_size=BS, metrics=metrics,
                     update_metrics=lambda m, loss, aux, batch: m.update(loss=loss))  # fmt: skip
