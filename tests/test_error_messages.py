"""Errors that name the real cause and the fix: another optimizer than the checkpoint's, a
Linen model, a missing optional extra."""

from __future__ import annotations

import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.shell import Population, Trainer, scan_train

from conftest import MLP, state_arrays, xent

# -- resuming with another optimizer ------------------------------------------------------------


@pytest.fixture(scope="module")
def adam_checkpoint(tmp_path_factory):
    """A checkpoint written by an Adam Trainer (before any step: the layout is what counts)."""
    directory = tmp_path_factory.mktemp("adam")
    Trainer(MLP(rngs=nnx.Rngs(0)), optax.adam(1e-2), xent).save(directory)
    return directory


@pytest.mark.parametrize(
    ("tx", "given"),
    [
        (optax.sgd(1e-2), "no arrays"),  # optax's SGD keeps no state
        (optax.sgd(1e-2, momentum=0.9), "[0].trace[...]"),
        (optax.chain(optax.clip(1.0), optax.adam(1e-2)), "[1][0].mu[...]"),
    ],
)
def test_another_optimizer_is_named_as_the_cause(adam_checkpoint, tx, given):
    trainer = Trainer(MLP(rngs=nnx.Rngs(1)), tx, xent)
    before = state_arrays(trainer.model)
    with pytest.raises(ValueError) as error:
        trainer.restore(adam_checkpoint)
    message = str(error.value)
    assert "saved with another optimizer" in message
    # What differs: Adam's count and moments in the checkpoint, the given transform's state.
    assert "[0].count, [0].mu[...], [0].nu[...]" in message
    assert given in message
    assert "the model's variables fit" in message
    assert "same layer sizes" not in message and "not in the model" not in message
    for a, b in zip(state_arrays(trainer.model), before, strict=True):
        np.testing.assert_array_equal(a, b)  # a failed restore changes nothing


def test_a_model_of_other_sizes_is_named_before_its_optimizer_state(adam_checkpoint):
    # Other layer sizes change Adam's moments too; the model is the cause.
    trainer = Trainer(MLP(hidden=16, rngs=nnx.Rngs(0)), optax.adam(1e-2), xent)
    with pytest.raises(ValueError, match=r"template at \['state'\]\['l1'\]\['bias'\].*\(8,\)"):
        trainer.restore(adam_checkpoint)


def test_the_same_optimizer_restores(adam_checkpoint):
    # adamw's state has Adam's layout (its weight decay keeps none): it restores.
    assert Trainer(MLP(rngs=nnx.Rngs(1)), optax.adamw(1e-2), xent).restore(adam_checkpoint) == 0


# -- a Linen model --------------------------------------------------------------------------------


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x)


LINEN = r"Flax Linen module.*nnxscan\.adapters\.linen\.LinenModule\(.*docs/porting\.md"


def test_a_linen_model_is_told_to_use_the_linen_adapter(data):
    with pytest.raises(TypeError, match=f"model is a {LINEN}"):
        Trainer(LinenMLP(), optax.adam(1e-2), xent)
    batches = {k: v[:32].reshape(2, 16, *v.shape[1:]) for k, v in data.items()}
    with pytest.raises(TypeError, match=f"model is a {LINEN}"):
        scan_train(LinenMLP(), None, xent, batches)  # no nnx.Optimizer can be built on it
    with pytest.raises(TypeError, match=f"returned LinenMLP, a {LINEN}"):
        Population(lambda rngs: LinenMLP(), optax.adam(1e-2), xent, seeds=[0, 1])
    with pytest.raises(TypeError, match=r"model must be an nnx\.Module, got dict"):
        Trainer({"params": 1}, optax.adam(1e-2), xent)


def test_the_wrapped_linen_model_trains(data):
    from nnxscan.adapters.linen import LinenModule

    model = LinenModule(LinenMLP(), data["x"][:1], rngs=nnx.Rngs(0), train_arg=None)
    history = Trainer(model, optax.adam(1e-2), xent).fit(
        data, epochs=1, batch_size=16, progress=False
    )
    assert np.isfinite(history.losses).all()


# -- a missing optional extra ---------------------------------------------------------------------

# The demo, run as the `nnxscan` command runs it, in a process where gymnax cannot be imported.
MISSING_GYMNAX = """
import sys
sys.modules["gymnax"] = None  # import gymnax now raises ImportError, as when not installed
from nnxscan.shell.cli import main
sys.exit(main(["demo", "ppo", "--no-compile-cache", "--out", sys.argv[1]]))
"""


@pytest.mark.slow  # a fresh Python process (~1.5 s)
def test_a_demo_without_its_extra_says_in_one_line_what_to_install(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", MISSING_GYMNAX, str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr  # no traceback, chained or not
    assert "nnxscan demo ppo needs gymnax" in lines[0]
    assert "pip install 'nnxscan[rl]'" in lines[0]  # from an index
    assert "pip install -e '.[rl]'" in lines[0]  # from a clone
    assert not list(tmp_path.iterdir())  # nothing trained, nothing written


def test_a_missing_extra_in_the_library_raises_one_import_error(monkeypatch):
    from nnxscan.adapters._extras import MissingExtraError, require_extra

    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(ImportError) as error:
        require_extra("tensorboardX", "tensorboard", needed_by="TensorBoardWriter")
    assert isinstance(error.value, MissingExtraError)
    assert error.value.__cause__ is None and error.value.__suppress_context__
    message = str(error.value)
    assert "pip install 'nnxscan[tensorboard]'" in message
    assert "pip install -e '.[tensorboard]'" in message


# -- a step that reads a global object: its own argument, or truly captured --------------------

# The newcomer's code: the model and its optimizer are globals, and the step, meant to use
# its arguments, reads the global `policy` (which IS the model it is called with).
policy = MLP(rngs=nnx.Rngs(0))
policy_optimizer = nnx.Optimizer(policy, optax.adam(1e-2), wrt=nnx.Param)
teacher = MLP(rngs=nnx.Rngs(1))  # another model, read by the step: truly captured


def step_reading_the_global_model(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(lambda m: xent(policy, batch))(model)
    optimizer.update(model, grads)
    return loss


def step_reading_the_global_optimizer(model, opt, batch):
    loss, grads = nnx.value_and_grad(xent)(model, batch)
    policy_optimizer.update(model, grads)
    return loss


def step_reading_a_submodule_of_the_model(model, optimizer, batch):
    return xent(model, batch) + policy.l1.kernel[...].sum() * 0.0


def step_reading_a_teacher(model, optimizer, batch):
    target = jax.nn.softmax(teacher(batch["x"]))
    loss, grads = nnx.value_and_grad(
        lambda m: optax.softmax_cross_entropy(m(batch["x"]), target).mean()
    )(model)
    optimizer.update(model, grads)
    return loss


ARGUMENT = r"which is the very object it receives as its argument '{0}'\. Use the argument \({0}\)"
CAPTURED = {
    "the model, from scan_train": (
        lambda b: scan_train(
            policy, policy_optimizer, batches=b, train_step=step_reading_the_global_model
        ),
        r"train_step captures an NNX object \(MLP\) \(the global 'policy'\), "
        + ARGUMENT.format("model"),
    ),
    "the model, from Trainer": (
        lambda b: Trainer(policy, policy_optimizer, train_step=step_reading_the_global_model),
        r"the global 'policy'\), " + ARGUMENT.format("model"),
    ),
    "the optimizer, by the step's own name for it": (
        lambda b: scan_train(
            policy, policy_optimizer, batches=b, train_step=step_reading_the_global_optimizer
        ),
        r"\(Optimizer\) \(the global 'policy_optimizer'\), " + ARGUMENT.format("opt"),
    ),
    "the model, read for a part of it": (
        lambda b: scan_train(
            policy, policy_optimizer, batches=b, train_step=step_reading_a_submodule_of_the_model
        ),
        r"\(the global 'policy'\), which is the very object",
    ),
    "the model, in a loss": (
        lambda b: Trainer(policy, optax.adam(1e-2), lambda m, batch: xent(policy.l1, batch)),
        r"loss_fn captures .* \(the global 'policy'\), " + ARGUMENT.format("m"),
    ),
    "the model, in scan_train's loss": (
        lambda b: scan_train(policy, policy_optimizer, lambda mdl, batch: xent(policy, batch), b),
        r"loss_fn captures .* \(the global 'policy'\), " + ARGUMENT.format("mdl"),
    ),
    "another model: extras": (
        lambda b: scan_train(
            policy, policy_optimizer, batches=b, train_step=step_reading_a_teacher
        ),
        r"train_step captures an NNX object \(MLP\) \(the global 'teacher'\)\. Inside the compiled "
        r"step it would be a constant, never updated\. Pass it in extras=\(\.\.\., it\)",
    ),
}


@pytest.mark.parametrize("case", list(CAPTURED), ids=list(CAPTURED))
def test_a_captured_object_is_told_apart_from_the_steps_own_argument(case, compile_count):
    """Reading the global that IS the step's argument is fixed by using the argument;
    reading another object, by passing it in extras. Nothing compiles, nothing changes."""
    call, message = CAPTURED[case]
    rng = np.random.default_rng(0)
    batches = {"x": rng.normal(size=(3, 8, 4)).astype(np.float32), "y": np.zeros((3, 8), np.int32)}
    before, compiled = state_arrays((policy, policy_optimizer)), compile_count()
    with pytest.raises(TypeError, match=message) as error:
        call(batches)
    assert ("extras" in str(error.value)) == (case == "another model: extras")
    assert compile_count() == compiled
    for got, want in zip(state_arrays((policy, policy_optimizer)), before, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_submodule_of_the_model_is_named_by_its_path():
    def loss(model, batch):
        return xent(model, batch) + encoder.kernel[...].sum()

    model = MLP(rngs=nnx.Rngs(0))
    encoder = model.l1  # a closure variable holding a part of the model
    with pytest.raises(TypeError, match=r"which is model\.l1, a part of the object it receives "
                       r"as its argument 'model'\. Use the argument \(model\.l1\)"):  # fmt: skip
        Trainer(model, optax.adam(1e-2), loss)
