"""Construction options declared once: every front door refuses a name it does not take with
the same kind of hint, before anything is built or compiled.

The reference is what the user wrote (the option, the front door) and the declaration each
front door advertises in its signature; the objects are compared with a snapshot taken
before the call that must fail.
"""

from __future__ import annotations

import ast
import inspect
import pathlib

import numpy as np
import optax
import pytest
from flax import nnx

from nnxscan.pure import make_train_step
from nnxscan.shell import Population, Trainer, scan_train
from nnxscan.shell._construction import DOORS

from conftest import MLP, state_arrays, xent

ROOT = pathlib.Path(__file__).resolve().parents[1]
TX = optax.adam(1e-2)
BATCHES = {"x": np.zeros((2, 4, 4), np.float32), "y": np.zeros((2, 4), np.int32)}


def mlp(rngs: nnx.Rngs) -> MLP:
    return MLP(rngs=rngs)


def build(door: str, **options):
    """The front door ``door`` on a small MLP with ``options``; returns the model it got."""
    model = MLP(rngs=nnx.Rngs(0))
    if door == "Trainer":
        Trainer(model, TX, xent, **options)
    elif door == "Population":
        Population(mlp, TX, xent, **{"seeds": [0, 1], **options})
    else:
        scan_train(model, nnx.Optimizer(model, TX, wrt=nnx.Param), xent, BATCHES, **options)
    return model


def refused(door: str, **options) -> str:
    model = MLP(rngs=nnx.Rngs(0))
    before = state_arrays(model)
    with pytest.raises(TypeError) as raised:
        if door == "scan_train":
            optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
            scan_train(model, optimizer, xent, BATCHES, **options)
            assert int(optimizer.step[...]) == 0
        else:
            build(door, **options)
    for got, want in zip(state_arrays(model), before, strict=True):
        np.testing.assert_array_equal(got, want)  # nothing trained, nothing written
    return str(raised.value)


DOOR_NAMES = ["Trainer", "Population", "scan_train"]


@pytest.mark.parametrize("door", DOOR_NAMES)
def test_a_learning_rate_says_to_pass_an_optimizer_built_with_it(door):
    message = refused(door, learning_rate=1e-3)
    assert message.startswith(f"{door}() got an unexpected keyword argument 'learning_rate': ")
    assert "the learning rate is the optimizer's" in message
    assert "optax.adam(1e-3)" in message
    assert f"{door}(model" in message
    assert refused(door, lr=0.1).split(": ", 1)[1] == message.split(": ", 1)[1]


@pytest.mark.parametrize(
    "door, wrong, right",
    [("Trainer", "has_axu", "has_aux"), ("Population", "exection", "execution"),
     ("scan_train", "batch_sise", "batch_size"), ("Population", "seed", "seeds")],
)  # fmt: skip
def test_a_misspelling_names_the_option_meant(door, wrong, right):
    message = refused(door, **{wrong: 1})
    assert message == (
        f"{door}() got an unexpected keyword argument {wrong!r}. Did you mean {right!r}?"
    )


@pytest.mark.parametrize("door", DOOR_NAMES)
def test_an_unknown_name_is_refused_plainly(door):
    assert refused(door, frobnicate=1) == (
        f"{door}() got an unexpected keyword argument 'frobnicate'."
    )


@pytest.mark.parametrize(
    "door, name, says",
    [("Trainer", "seeds", "seeds is an option of Population, not of Trainer"),
     ("Population", "extras", "extras is an option of Trainer and scan_train, not of Population"),
     ("scan_train", "on_nonfinite", "on_nonfinite is an option of Trainer and Population"),
     ("Trainer", "epochs", "epochs is an option of fit, not of Trainer: trainer.fit(data, "
                           "epochs=...)"),
     ("Population", "batch_size", "population.fit(data, batch_size=...)"),
     ("scan_train", "callbacks", "Trainer(model, optimizer, loss_fn).fit(data, callbacks=...)"),
     ("Trainer", "optimizer", "pass it by position, Trainer(model, optax.adam(1e-3), loss_fn)")],
)  # fmt: skip
def test_another_front_doors_option_or_fits_says_where_it_goes(door, name, says):
    assert says in refused(door, **{name: 1})


def test_population_needs_its_seeds():
    with pytest.raises(TypeError, match=r"^Population needs seeds=: Population\(model_fn"):
        Population(mlp, TX, xent)


def test_each_front_door_advertises_its_declaration():
    for door, function in [("Trainer", Trainer.__init__), ("Population", Population.__init__),
                           ("scan_train", scan_train)]:  # fmt: skip
        annotation = inspect.signature(function).parameters["options"].annotation
        assert annotation == f"Unpack[{DOORS[door].__name__}]"


def test_options_of_the_step_built_from_a_loss_are_refused_with_a_users_step():
    step = make_train_step(xent, TX)
    model = MLP(rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"so wrt, accumulate have no effect"):
        Trainer(model, train_step=step, wrt=nnx.Variable, accumulate=2)
    Trainer(model, train_step=step, wrt=nnx.Param, accumulate=1, has_aux=False)  # defaults
    with pytest.raises(TypeError, match=r"so loss_fn, rngs have no effect"):
        scan_train(model, None, xent, BATCHES, train_step=step, rngs=nnx.Rngs(0))


def test_which_kind_of_step_is_decided_in_one_place():
    """``isinstance(..., Step)`` in the shell: only ``_construction.step_kind``."""
    sites = []
    for path in sorted((ROOT / "shell").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            is_call = isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance"
            if is_call and ast.unparse(node.args[1]).split(".")[-1] == "Step":
                sites.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(sites) == 1 and sites[0].startswith("shell/_construction.py:"), sites
