"""What a newcomer sees first: ``nnxscan --help``, ``--version``, and the progress line."""

from __future__ import annotations

import ast
import importlib.metadata
import io
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from rich.console import Console

from nnxscan.shell import Trainer
from nnxscan.shell._edges.progress import RunProgress
from nnxscan.shell._engine.layout import ONE_MODEL, Members
from nnxscan.shell.cli import main

from conftest import MLP, xent

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _help(argv: list[str], capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_help_is_plain_text_that_describes_each_demo_and_option(capsys, monkeypatch):
    top = _help(["--help"], capsys, monkeypatch)
    demo = _help(["demo", "--help"], capsys, monkeypatch)
    for text in (top, demo):
        assert "`" not in text and ":class:" not in text
        assert max(len(line) for line in text.splitlines()) <= 80
        assert re.search(r"digits\s+an MLP on scikit-learn's digits", text)
        assert re.search(r"hypernet\s+one hypernetwork learns a family of sine functions", text)
    assert "--version" in top and "demo" in top
    for option, words in [
        ("--out OUT", "folder to write the PNG"),
        ("--seed N", "seeds the data"),
        ("--no-progress", "show no progress bar"),
    ]:
        assert re.search(rf"{option}\s+{words}", demo), option
    assert "nnxscan_demo_NAME.png" in demo


def test_version_prints_the_installed_distribution_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"nnxscan {importlib.metadata.version('nnxscan')}\n"
    # The console script, as a user runs it.
    beside = pathlib.Path(sys.executable).parent / "nnxscan"
    exe = str(beside) if beside.exists() else shutil.which("nnxscan")
    assert exe, "the nnxscan console script is not installed"
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True)
    assert re.fullmatch(r"nnxscan \d+\.\d+\S*\n", out.stdout)


def test_the_package_version_is_pyprojects_and_importing_it_loads_nothing():
    import tomllib

    import nnxscan

    pyproject = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert nnxscan.__version__ == pyproject["project"]["version"]  # the single source
    assert nnxscan.__version__ == importlib.metadata.version("nnxscan")
    assert "__version__" in dir(nnxscan)
    from nnxscan import __version__

    assert __version__ == nnxscan.__version__
    # `import nnxscan` alone loads none of its packages, and no jax.
    code = "import sys, nnxscan; print(sorted(m for m in sys.modules if '.' in m or m == 'jax'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = ast.literal_eval(out.stdout)  # a list of module names
    assert not [m for m in loaded if m == "jax" or m.startswith(("nnxscan.", "jax."))], loaded


EPOCH_LOGS = {"loss": 0.1234, "eval_loss": 0.05678, "eval_accuracy": 0.98123}


def _terminal_frames(width: int, *, calls_per_epoch: int | None, rate: float, loss: float):
    """Every frame a RunProgress draws in a terminal ``width`` columns wide, as plain text."""
    out = io.StringIO()
    console = Console(width=width, force_terminal=True, file=out)
    calls = None if calls_per_epoch is None else 30 * calls_per_epoch
    with RunProgress(calls, True, console=console, layout=ONE_MODEL) as bar:
        for epoch in (11, 12):
            for _ in range(calls_per_epoch or 5):
                bar.call_done(epoch, 10, jax.block_until_ready(jnp.array([0.5, loss])))
            bar.epoch_done(epoch, {**EPOCH_LOGS, "loss": loss, "steps_per_sec": rate})
    frames = re.split(r"[\r\n]", ANSI.sub("", out.getvalue()))
    return [frame for frame in frames if frame.strip()]


@pytest.mark.parametrize("calls_per_epoch", [100, None])
@pytest.mark.parametrize(("rate", "loss"), [(12_345.0, 0.1234), (1_234_567.0, 1.2345e-5)])
def test_terminal_progress_line_fits_80_columns_and_shows_the_key_fields(
    calls_per_epoch, rate, loss
):
    frames = _terminal_frames(80, calls_per_epoch=calls_per_epoch, rate=rate, loss=loss)
    assert frames and all(len(frame) <= 80 for frame in frames), frames
    last = frames[-1]  # drawn on exit, after the last epoch
    assert "epoch 12" in last and f"loss {loss:.4g}" in last and f"{rate:,.0f} steps/s" in last
    assert "…" not in last  # nothing cut short
    if calls_per_epoch is not None:
        assert "200/3000" in last  # calls done / planned


def test_terminal_progress_line_shows_eval_metrics_where_they_fit():
    wide = _terminal_frames(120, calls_per_epoch=100, rate=12_345.0, loss=0.1234)[-1]
    assert "eval_loss 0.05678" in wide and "eval_accuracy 0.9812" in wide
    assert len(wide) <= 120


def test_plain_epoch_lines_off_a_terminal_fit_80_columns():
    out = io.StringIO()
    console = Console(width=200, force_terminal=False, file=out)
    with RunProgress(1000, True, last_epoch=12, console=console, layout=ONE_MODEL) as bar:
        for epoch in (11, 12):  # the first line, then the last epoch's
            bar.epoch_done(epoch, {**EPOCH_LOGS, "steps_per_sec": 12_345.0})
    lines = out.getvalue().splitlines()
    assert lines == [
        "epoch 11  loss 0.1234  eval_loss 0.05678  eval_accuracy 0.9812  12,345 steps/s",
        "epoch 12  loss 0.1234  eval_loss 0.05678  eval_accuracy 0.9812  12,345 steps/s",
    ]
    assert all(len(line) <= 80 for line in lines)


def test_a_long_epoch_line_off_a_terminal_stays_one_line(data, capsys):
    """Off a terminal (a log file, CI) a line longer than rich's default 80 columns is
    printed whole, not wrapped onto a second line."""

    def metrics(model, batch):
        hits = model(batch["x"]).argmax(-1) == batch["y"]
        return {"accuracy_of_the_model_on_the_held_out_examples": hits.mean(), "n": hits.sum()}

    trainer = Trainer(MLP(rngs=nnx.Rngs(0)), optax.adam(1e-2), xent)
    history = trainer.fit(
        data, epochs=1, batch_size=16, eval_data=data, metric_fn=metrics, progress=True
    )
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    accuracy = history.epochs[0]["eval_accuracy_of_the_model_on_the_held_out_examples"]
    assert f"eval_accuracy_of_the_model_on_the_held_out_examples {accuracy:.4g}" in lines[0]
    assert lines[0].startswith("epoch 0  loss ") and "steps/s" in lines[0]
    assert len(lines[0]) > 80


def test_the_terminal_line_shows_each_calls_mean_of_the_steps_scalar_logs():
    """A step's aux leaves that are a scalar per step (an RL step's return) are shown as
    the mean over each call's steps, next to the loss of its last step; the epoch's end
    shows the epoch's logs. Leaves of another shape are not shown."""
    returns = np.array([[10.0, 20.0, 60.0], [5.0, 7.0, 12.0]])
    losses = np.array([[0.5, 0.4, 0.3], [0.2, 0.1, 0.05]])
    frames_after = []
    for width in (80, 120):
        out = io.StringIO()
        console = Console(width=width, force_terminal=True, file=out)
        # The PPO demo's bar: 61 epochs of 16 calls.
        with RunProgress(61 * 16, True, has_aux=True, console=console, layout=ONE_MODEL) as bar:
            for call in range(2):
                aux = {"episode_return": jnp.asarray(returns[call]), "per_env": jnp.zeros((3, 4))}
                # Ready outputs: the line shows only what is ready (it never waits), and
                # on an accelerator a fresh transfer may still be under way.
                out_of_call = jax.block_until_ready((jnp.asarray(losses[call]), aux))
                bar.call_done(0, 3, out_of_call)
                bar._progress.refresh()  # draw this call's frame now
                frames_after.append(re.split(r"[\r\n]", ANSI.sub("", out.getvalue()))[-1])
        for frame in frames_after[-2:]:
            assert len(frame) <= width and "per_env" not in frame
    for frame, call in zip(frames_after, [0, 1, 0, 1], strict=True):
        assert f"loss {losses[call][-1]:.4g}" in frame
        assert f"episode_return {returns[call].mean():.4g}" in frame
    assert "steps/s" in frames_after[3]  # 120 columns: room for the rate too


def test_the_epoch_line_off_a_terminal_shows_the_epochs_scalar_logs():
    out = io.StringIO()
    console = Console(width=80, force_terminal=False, file=out)
    layout = Members(2)
    with RunProgress(2, True, last_epoch=0, has_aux=True, console=console, layout=layout) as bar:
        aux = {"episode_return": jnp.zeros((3, 2)), "per_env": jnp.zeros((3, 2, 4))}
        bar.call_done(0, 3, (jnp.zeros((3, 2)), aux))
        logs = {"loss": np.array([0.5, 0.25]), "episode_return": np.array([10.0, 30.0, 50.0])}
        bar.epoch_done(0, {**logs, "steps_per_sec": 100.0})
    line = out.getvalue().strip()
    assert line.startswith("epoch 0  loss median 0.375") and "per_env" not in line
    assert "  episode_return median 30  100 steps/s" in line


def test_log_names_choose_the_scalar_logs_of_the_line_in_their_order():
    """PPO's aux reaches the shell sorted by name (a dict through jit): the return comes
    after actor_loss and entropy and would not fit 80 columns; ``log_names`` puts it first."""
    aux = {
        "actor_loss": jnp.full(3, -0.0019635),
        "entropy": jnp.full(3, 0.66041),
        "episode_return": jnp.asarray([30.0, 34.0, 38.0]),
    }
    shown = {}
    for names in (None, ["episode_return"]):
        out = io.StringIO()
        console = Console(width=80, force_terminal=True, file=out)
        with RunProgress(
            61 * 16, True, has_aux=True, console=console, layout=ONE_MODEL, log_names=names
        ) as bar:
            bar.call_done(0, 3, jax.block_until_ready((jnp.asarray([26.5, 26.5, 26.47]), aux)))
            bar._progress.refresh()  # draw this call's frame now
            shown[names is None] = re.split(r"[\r\n]", ANSI.sub("", out.getvalue()))[-1]
    assert "episode_return" not in shown[True] and "actor_loss -0.001963" in shown[True]
    assert "loss 26.47  episode_return 34 " in shown[False] and "entropy" not in shown[False]
