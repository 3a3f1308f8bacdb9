"""``find_learning_rate``: N rates side by side in one Population, each = its own Trainer run."""

from __future__ import annotations

import re
import warnings

import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.shell import LRFinderResult, NonFiniteLossWarning, Trainer, find_learning_rate

from conftest import MLP, make_data, xent

SEED, BATCH, STEPS, NUM = 3, 16, 10, 4  # 4 steps an epoch: the run crosses 2 epochs
MIN_LR, MAX_LR = 1e-3, 1.0


def mlp(rngs):
    return MLP(rngs=rngs)


def alone(data, rate, tx, steps=STEPS):
    """The independent reference: one Trainer run at ``rate`` from the seed's weights,
    shuffled by the same seed, for enough whole epochs to cover ``steps``."""
    epochs = -(-steps // (len(data["x"]) // BATCH))
    model = MLP(rngs=nnx.Rngs(SEED))
    history = Trainer(model, tx(rate), xent).fit(
        data, epochs=epochs, batch_size=BATCH, seed=SEED, progress=False
    )
    return np.asarray(history.losses[:steps], np.float64)


@pytest.fixture(scope="module")
def found_and_warnings(data):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = find_learning_rate(
            mlp, xent, data, batch_size=BATCH, min_lr=MIN_LR, max_lr=MAX_LR, num=NUM,
            steps=STEPS, seed=SEED, window=3,
        )  # fmt: skip
    return result, [w for w in caught if issubclass(w.category, UserWarning)]


@pytest.fixture(scope="module")
def found(found_and_warnings):
    return found_and_warnings[0]


def injected_adam(rate):
    return optax.inject_hyperparams(optax.adam)(learning_rate=rate)


@pytest.mark.slow
def test_each_rate_equals_its_own_trainer_run(found, data):
    rates = np.geomspace(MIN_LR, MAX_LR, NUM)
    np.testing.assert_allclose(found.learning_rates, rates, rtol=1e-12)
    assert found.losses.shape == (STEPS, NUM)
    finals = []
    for i, rate in enumerate(rates):
        # The population tests' reference and tolerance: the member's own transform alone.
        reference = alone(data, float(rate), injected_adam)
        np.testing.assert_allclose(found.losses[:, i], reference, rtol=1e-5, atol=1e-6)
        # A plain optax.adam(rate), whose constant rate XLA folds and rounds otherwise:
        # the same run up to float rounding (at rate 1, Adam's normalized steps amplify
        # it to ~2e-5 after 10 steps).
        plain = alone(data, float(rate), optax.adam)
        np.testing.assert_allclose(found.losses[:, i], plain, rtol=1e-4, atol=1e-6)
        finals.append(reference[-3:].mean())
    np.testing.assert_allclose(found.final_losses, finals, rtol=1e-5)
    # The stated rule, applied by hand to the separate runs' final losses.
    finals = np.asarray(finals)
    assert not found.diverged.any()
    near = finals <= finals.min() + 0.1 * abs(finals.min())
    assert found.suggestion == pytest.approx(rates[np.flatnonzero(near)[0]])
    assert found.best == int(np.argmin(finals))


def result_with(finals, diverged, rates=(1e-4, 1e-3, 1e-2, 1e-1, 1.0), tolerance=0.1):
    losses = np.vstack([np.full(len(rates), 2.0), np.asarray(finals, np.float64)])
    return LRFinderResult(
        learning_rates=np.asarray(rates), losses=losses, final_losses=np.asarray(finals),
        diverged=np.asarray(diverged), window=1, tolerance=tolerance, suggestion=None,
    )  # fmt: skip


def test_the_suggestion_is_the_smallest_rate_within_tolerance_of_the_best():
    # 1e-1 is the best that did not diverge (0.40); the diverged 1.0 (0.1) never counts.
    result = result_with([1.0, 0.50, 0.43, 0.40, 0.10], [False, False, False, False, True])
    assert result.best == 3
    assert result.suggest() == 1e-2  # 0.43 <= 0.40 * 1.1 = 0.44; 0.50 is not
    assert result.suggest(0.3) == 1e-3  # 0.50 <= 0.52
    assert result.suggest(0.0) == 1e-1  # the lowest itself
    assert result.suggest(10.0) == 1e-4  # every rate that did not diverge
    # Negative losses: the band is best + tolerance * |best|, above the best.
    negative = result_with([-1.0, -1.95, -2.0, -1.0, -5.0], [False] * 4 + [True])
    assert negative.suggest() == 1e-3
    assert result_with([np.nan] * 5, [True] * 5).suggest() is None
    with pytest.raises(ValueError, match="tolerance must be a non-negative fraction"):
        result.suggest(-0.1)


@pytest.mark.slow
def test_a_diverging_rate_is_excluded_and_frozen_where_its_loss_became_non_finite(data):
    """SGD at 1e-2, 1e2 and 1e6: the two large rates blow up (one to a non-finite loss, in
    the middle of a call of 7 steps), the small one trains; no warning escapes but the one
    that says the suggestion is the smallest rate tried."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.warns(UserWarning, match=r"smallest rate tried.*lower min_lr") as caught:
            result = find_learning_rate(
                mlp, xent, data, batch_size=BATCH, min_lr=1e-2, max_lr=1e6, num=3, steps=20,
                optimizer=optax.sgd, seed=SEED, steps_per_call=7,
            )  # fmt: skip
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteLossWarning)  # the reference runs blow up
        references = [
            alone(data, float(rate), optax.sgd, steps=20) for rate in result.learning_rates
        ]
    for i, reference in enumerate(references):
        finite = np.isfinite(reference)
        if finite.all():
            np.testing.assert_allclose(result.losses[:, i], reference, rtol=1e-5, atol=1e-6)
        else:
            # Up to its first non-finite loss the rate trains what it trains alone; from
            # there on its curve is NaN (frozen), and its final loss too.
            first = int(np.argmin(finite))
            np.testing.assert_allclose(result.losses[:first, i], reference[:first], rtol=1e-4)
            assert np.isnan(result.losses[first:, i]).all()
            assert np.isnan(result.final_losses[i])
        # Diverged: a non-finite loss, or a final loss above 4x the starting loss.
        ended = reference[-result.window :].mean()
        assert result.diverged[i] == (not finite.all() or ended > 4 * reference[0])
    assert not np.isfinite(references[2]).all(), "the largest rate should blow up"
    assert list(result.diverged) == [False, True, True]
    assert result.suggestion == pytest.approx(1e-2)
    assert "diverged" in result.table().splitlines()[-1]


def sgd_range(min_lr, max_lr):
    """An SGD range test of 3 rates, and the warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = find_learning_rate(
            mlp, xent, data=make_data(), batch_size=BATCH, min_lr=min_lr, max_lr=max_lr,
            num=3, steps=STEPS, optimizer=optax.sgd, seed=SEED,
        )  # fmt: skip
    return result, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.slow_on_accelerator("two learning-rate sweeps: 4.3 s")
def test_a_suggestion_at_either_end_of_the_range_warns_to_widen_it():
    """Whether the suggestion sits at an end is read from the result itself (its rates,
    final losses and the stated rule), not from a machine's digits."""
    # SGD learns faster the larger its rate here: the largest rate tried is suggested.
    result, messages = sgd_range(1e-2, 1.0)
    assert result.suggestion == result.learning_rates[-1] and not result.diverged.any()
    assert result.best == 2  # the lowest final loss is the largest rate's
    assert len(messages) == 1 and "the suggestion 1 is the largest rate tried" in messages[0]
    assert "raise max_lr" in messages[0]
    # Rates too small to train in 10 steps: every final loss ties within the tolerance,
    # and the rule's smallest rate says nothing; the message says so, and to widen upward.
    result, messages = sgd_range(1e-5, 1e-3)
    finals = result.final_losses
    assert (finals <= finals.min() * 1.1).all() and not result.diverged.any()
    assert result.suggestion == result.learning_rates[0]
    assert len(messages) == 1 and "does not tell the rates apart" in messages[0]
    assert "raise max_lr" in messages[0] and "1e-05 to 0.001" in messages[0]
    # (A smallest rate suggested because every larger one diverged: lower min_lr, in
    # test_a_diverging_rate_is_excluded_and_frozen_where_its_loss_became_non_finite.)


@pytest.mark.slow_on_accelerator("a range test compiled")
def test_a_suggestion_inside_the_range_does_not_warn(found_and_warnings):
    result, caught = found_and_warnings
    assert 0 < list(result.learning_rates).index(result.suggestion) < NUM - 1
    assert caught == []


@pytest.mark.slow_on_accelerator("a learning-rate sweep and its figure: 4.3 s")
def test_the_figure_draws_a_curve_per_rate_and_final_loss_against_a_log_rate(found, tmp_path):
    fig = found.plot(tmp_path / "lr.png")
    assert (tmp_path / "lr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curves, finals = fig.axes
    assert len(curves.get_lines()) == NUM
    assert curves.get_xlabel() == "step"
    assert curves.get_ylabel() == "training loss (mean of the last 3 steps)"
    for i, line in enumerate(curves.get_lines()):
        np.testing.assert_array_equal(line.get_xdata(), np.arange(1, STEPS + 1))
        # Each curve ends at its rate's final loss (the mean of the last 3 steps).
        assert line.get_ydata()[-1] == pytest.approx(found.final_losses[i], rel=1e-9)
        assert line.get_label() == f"{found.learning_rates[i]:.2g}"
    assert finals.get_xscale() == "log"
    assert finals.get_xlabel() == "learning rate"
    assert finals.get_ylabel() == "final loss (mean of the last 3 steps)"
    by_label = {line.get_label(): line for line in finals.get_lines()}
    np.testing.assert_allclose(by_label["final loss"].get_xdata(), found.learning_rates)
    np.testing.assert_allclose(by_label["final loss"].get_ydata(), found.final_losses)
    marker = by_label[f"suggested {found.suggestion:.2g}"]
    assert list(marker.get_xdata()) == [found.suggestion] * 2  # a vertical line


def test_the_figure_marks_diverged_rates_with_crosses(tmp_path):
    result = result_with([1.0, 0.5, 0.4, 3.0, np.nan], [False, False, False, True, True])
    result = LRFinderResult(**{**result.__dict__, "suggestion": result.suggest()})
    _, finals = result.plot(tmp_path / "new" / "folder" / "lr.png").axes  # folders made
    assert (tmp_path / "new" / "folder" / "lr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    crosses = [line for line in finals.get_lines() if line.get_marker() == "x"]
    xs = sorted(x for line in crosses for x in line.get_xdata())
    assert xs == [1e-1, 1.0]  # the one above the start at its loss, the NaN one at the top
    line = next(line for line in finals.get_lines() if line.get_label() == "final loss")
    assert np.isnan(line.get_ydata()[3:]).all()  # the line joins only the kept rates


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"batch_size": 65}, ValueError, r"batch_size 65 is larger than the number of examples 64"),
        ({"min_lr": 1.0, "max_lr": 1e-3}, ValueError, r"min_lr 1 must be smaller than max_lr"),
        ({"min_lr": 0.0}, ValueError, r"min_lr must be a positive finite number"),
        ({"max_lr": float("inf")}, ValueError, r"max_lr must be a positive finite number"),
        ({"num": 1}, ValueError, r"num must be at least 2"),
        ({"steps": 0}, ValueError, r"steps must be at least 1"),
        ({"steps": 2.5}, TypeError, r"steps must be an int"),
        ({"window": 11}, ValueError, r"window 11 is larger than steps 10"),
        ({"tolerance": -1}, ValueError, r"tolerance must be a non-negative fraction"),
        ({"optimizer": optax.adam(1e-3)}, TypeError, r"Pass the function, not optax.adam"),
        ({"optimizer": lambda lr: optax.adam(lr)}, TypeError, r"optimizer\(learning_rate=...\)"),
        ({"data": [{"x": np.zeros((4, 4))}]}, TypeError, r"data must be a data set"),
        ({"data": {"x": np.zeros((4, 4)), "y": np.zeros(5)}}, ValueError, r"disagree"),
        ({"model_fn": None}, TypeError, r"model_fn must be callable"),
    ],
)
def test_bad_input_is_refused_before_anything_compiles(data, compile_count, change, error, match):
    arguments = dict(model_fn=mlp, loss_fn=xent, data=data, batch_size=BATCH, steps=STEPS, num=NUM)
    arguments.update(change)
    with pytest.raises(error, match=match):
        find_learning_rate(**arguments)
    assert compile_count() == 0


@pytest.mark.slow
def test_lr_find_demo_prints_a_table_and_writes_the_figure(tmp_path, capsys):
    pytest.importorskip("sklearn")
    from nnxscan.shell.cli import main

    out = tmp_path / "out"
    argv = ["demo", "lr-find", "--steps", "12", "--out", str(out), "--no-progress"]
    assert main([*argv, "--no-compile-cache"]) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if re.match(r"\s+\d[\d.e+-]*\s+([\d.]+|-)", line)]
    assert len(rows) == 16
    match = re.search(r"suggested learning rate: ([\d.e+-]+)", printed)
    assert match and any("suggested" in row for row in rows)
    png = (out / "nnxscan_demo_lr-find.png").resolve()
    assert f"wrote {png}" in printed.splitlines()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.filterwarnings("ignore:the suggestion .* rate tried")
@pytest.mark.slow_on_accelerator("a range test and a trainer compiled")
def test_a_data_set_not_a_multiple_of_the_batch_drops_the_rest_as_trainer_does():
    data = make_data(n=37)  # 2 batches of 16 an epoch, 5 examples dropped each epoch
    result = find_learning_rate(
        mlp, xent, data, batch_size=BATCH, min_lr=1e-2, max_lr=1e-1, num=2, steps=5, seed=SEED
    )
    for i, rate in enumerate(result.learning_rates):
        reference = alone(data, float(rate), injected_adam, steps=5)
        np.testing.assert_allclose(result.losses[:, i], reference, rtol=1e-5, atol=1e-6)
