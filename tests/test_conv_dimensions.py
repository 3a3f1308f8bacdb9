"""canonical_conv_dimensions against the untouched step jitted on its own, step by step.

The reference everywhere is the step as the user wrote it, under ``jax.jit``, one call per
step: XLA:CPU canonicalizes convolutions in a program's entry computation itself, so the
rewritten step must give its results there and inside a ``lax.scan`` (where XLA does not
canonicalize). To rounding, not bitwise: the rewritten and the original programs are two
programs, and XLA:CPU picks convolution kernels per CPU model and fuses a loop body on its
own terms. On CI's CPU they agree bitwise; on an AMD EPYC the nested convolutions'
gradients differ by up to 1.04e-7. What holds bitwise everywhere is the same program: the
scan Trainer.fit compiles is a scan of the rewritten step (docs/pure_core.md checks it).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

from nnxscan.pure import canonical_conv_dimensions, init_opt_state, make_train_step, scan_steps

from conftest import ACROSS_PROGRAMS, MLP, make_data, state_arrays, xent

STEPS = 4
BATCH = 8


# -- models, one per kind of convolution ------------------------------------------------------


class TutorialCNN(nnx.Module):
    """The Flax NNX MNIST tutorial's CNN (conv, relu, avg_pool twice, two Linears) on 8×8."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(2 * 2 * 64, 256, rngs=rngs)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.conv1(x)))
        x = self.avg_pool(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


class TutorialBNDropout(nnx.Module):
    """The flax 0.12.8 tutorial's CNN, verbatim but for ``linear1``'s input size (8×8):
    BatchNorm and Dropout, call-time ``nnx.Rngs``, trained in train mode."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(2 * 2 * 64, 256, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


class SmallBNDropout(nnx.Module):
    """BatchNorm and Dropout (its Rngs kept in the module) after small convolutions."""

    def __init__(self, *, rngs: nnx.Rngs):
        # No bias before BatchNorm: its gradient is rounding noise, which Adam would
        # amplify into lr-sized steps and make equal-up-to-rounding runs diverge.
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, rngs=rngs)
        self.drop1 = nnx.Dropout(0.2, rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(16, rngs=rngs)
        self.linear = nnx.Linear(2 * 2 * 16, 10, rngs=rngs)
        self.drop2 = nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, x):
        pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        x = pool(nnx.relu(self.bn1(self.drop1(self.conv1(x)))))
        x = pool(nnx.relu(self.bn2(self.conv2(x))))
        return self.linear(self.drop2(x.reshape(x.shape[0], -1)))


class StridedDilated(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 6, kernel_size=(3, 2), strides=(2, 1), rngs=rngs)
        self.conv2 = nnx.Conv(
            6, 8, kernel_size=(2, 3), kernel_dilation=(2, 1), padding=((1, 0), (2, 1)), rngs=rngs
        )
        self.conv3 = nnx.Conv(
            8, 4, kernel_size=(2, 2), input_dilation=2, padding=((1, 1), (0, 1)), rngs=rngs
        )
        self.out = nnx.Linear(4, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.conv2(nnx.relu(self.conv1(x))))
        return self.out(self.conv3(x).mean((1, 2)))


class Grouped(nnx.Module):
    """A grouped convolution (ResNeXt-style) and a depthwise one."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.stem = nnx.Conv(1, 6, kernel_size=(3, 3), rngs=rngs)
        self.grouped = nnx.Conv(6, 9, kernel_size=(3, 3), feature_group_count=3, rngs=rngs)
        self.depthwise = nnx.Conv(9, 9, kernel_size=(3, 3), feature_group_count=9, rngs=rngs)
        self.out = nnx.Linear(9, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.grouped(nnx.relu(self.stem(x))))
        return self.out(nnx.relu(self.depthwise(x)).mean((1, 2)))


class Conv1D(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 6, kernel_size=(3,), rngs=rngs)
        self.conv2 = nnx.Conv(6, 8, kernel_size=(5,), strides=2, rngs=rngs)
        self.out = nnx.Linear(8, 10, rngs=rngs)

    def __call__(self, x):  # x: (batch, 8, 8, 1) read as 8 channels-last rows of 8
        x = x.reshape(x.shape[0], 64, 1)
        return self.out(nnx.relu(self.conv2(nnx.relu(self.conv1(x)))).mean(1))


class Conv3D(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 4, kernel_size=(2, 3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(4, 6, kernel_size=(2, 2, 2), strides=(1, 2, 2), rngs=rngs)
        self.out = nnx.Linear(6, 10, rngs=rngs)

    def __call__(self, x):  # (batch, 8, 8, 1) -> (batch, 2, 4, 8, 1)
        x = x.reshape(x.shape[0], 2, 4, 8, 1)
        return self.out(nnx.relu(self.conv2(nnx.relu(self.conv1(x)))).mean((1, 2, 3)))


class NCHW(nnx.Module):
    """PyTorch's layout: lax.conv_general_dilated with ("NCHW", "OIHW", "NCHW")."""

    def __init__(self, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=0)
        self.k1 = nnx.Param(init(rngs.params(), (8, 1, 3, 3)))
        self.k2 = nnx.Param(init(rngs.params(), (16, 8, 3, 3)))
        self.out = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        x = jnp.transpose(x, (0, 3, 1, 2))
        conv = functools.partial(
            lax.conv_general_dilated, dimension_numbers=("NCHW", "OIHW", "NCHW")
        )
        x = nnx.relu(conv(x, self.k1[...], (1, 1), "SAME"))
        x = nnx.relu(conv(x, self.k2[...], (2, 2), ((1, 1), (0, 1))))
        return self.out(x.mean((2, 3)))


def image_xent(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def tutorial_loss(model, batch, rngs):
    """The tutorial's loss_fn: call-time Rngs, the logits as aux."""
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, logits


def tutorial_nodes(seed: int = 0):
    model = TutorialBNDropout(rngs=nnx.Rngs(seed))
    return nnx.view(model, deterministic=False, use_running_average=False), nnx.Rngs(seed)


def plain(cls):
    return lambda seed=0: cls(rngs=nnx.Rngs(seed))


# name: (nodes(seed) to split, optax transform, make_train_step options and loss)
MODELS = {
    "tutorial_cnn": (plain(TutorialCNN), optax.adamw(0.005, 0.9), {}),
    "tutorial_bn_dropout": (
        tutorial_nodes,
        optax.adamw(0.005, 0.9),
        dict(loss_fn=tutorial_loss, has_aux=True, with_rngs=True),
    ),
    "strided_dilated": (plain(StridedDilated), optax.sgd(0.1), {}),
    "grouped": (plain(Grouped), optax.adam(1e-2), {}),
    "conv_1d": (plain(Conv1D), optax.sgd(0.1), {}),
    "conv_3d": (plain(Conv3D), optax.sgd(0.1), {}),
    "nchw": (plain(NCHW), optax.adam(1e-2), {}),
}
# Even on CI's CPU not bitwise in a scan (see test_scan_of_small_batchnorm_model_is_close),
# where the MODELS are: kept apart.
SMALL_BN = (plain(SmallBNDropout), optax.adam(1e-2), {})


def digits_like(steps: int, seed: int = 0) -> dict:
    """``steps`` batches of 8×8 one-channel images with labels, stacked."""
    rng = np.random.default_rng(seed)
    return {
        "image": rng.uniform(size=(steps, BATCH, 8, 8, 1)).astype(np.float32),
        "label": rng.integers(0, 10, (steps, BATCH)).astype(np.int32),
    }


class Case:
    """One model's step and its reference trajectory: the untouched step, jitted on its
    own, called once per step."""

    def __init__(self, nodes, tx, options):
        options = dict(options)
        loss_fn = options.pop("loss_fn", image_xent)
        self.graphdef, self.state = nnx.split(nodes())
        self.opt_state = init_opt_state(tx, self.state)
        self.step = make_train_step(loss_fn, tx, **options)
        self.batches = digits_like(STEPS)
        reference = jax.jit(self.step.update, static_argnums=0)
        self.trajectory = list(self.run_per_step(reference))

    def run_per_step(self, step):
        """``(state arrays, opt_state arrays, loss)`` after each step of ``step``."""
        state, opt_state = self.state, self.opt_state
        for i in range(STEPS):
            batch = jax.tree.map(lambda x, i=i: x[i], self.batches)
            state, opt_state, out = step(self.graphdef, state, opt_state, batch)
            loss = out[0] if isinstance(out, tuple) else out
            yield state_arrays(state), state_arrays(opt_state), np.asarray(loss), state

    def scan(self, step):
        state, opt_state, outs = jax.jit(scan_steps, static_argnums=(0, 1))(
            step, self.graphdef, self.state, self.opt_state, self.batches
        )
        losses = outs[0] if isinstance(outs, tuple) else outs
        return state_arrays(state), state_arrays(opt_state), np.asarray(losses)


@functools.cache
def case_of(name: str) -> Case:
    """Each model's Case is built (and its reference compiled) once per session."""
    return Case(*MODELS[name])


# The slow lane (pyproject.toml) holds the models whose layouts the fast lane's cases
# (NCHW, the tutorial's BatchNorm + Dropout) already cover in kind.
SLOW_CASES = {"tutorial_cnn", "strided_dilated", "grouped", "conv_3d", "conv_1d"}


@pytest.fixture(
    params=[pytest.param(n, marks=[pytest.mark.slow] if n in SLOW_CASES else []) for n in MODELS]
)
def case(request) -> Case:
    return case_of(request.param)


def assert_to_rounding(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    """Floats to float32 rounding over a few steps (two programs: see the module's
    docstring and conftest's ACROSS_PROGRAMS); integers (RNG keys and counts) exactly."""
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if np.issubdtype(a.dtype, np.inexact):
            np.testing.assert_allclose(a, b, **ACROSS_PROGRAMS, err_msg=f"{what}, leaf {i}")
        else:
            np.testing.assert_array_equal(a, b, err_msg=f"{what}, leaf {i}")


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
def test_rewritten_step_equals_the_jitted_step(case):
    rewritten = jax.jit(canonical_conv_dimensions(case.step), static_argnums=0)
    for i, (got, want) in enumerate(
        zip(case.run_per_step(rewritten), case.trajectory, strict=True)
    ):
        for part, a, b in zip(("state", "opt_state"), got[:2], want[:2], strict=True):
            assert_to_rounding(a, b, f"step {i} {part}")
        np.testing.assert_allclose(got[2], want[2], **ACROSS_PROGRAMS, err_msg=f"step {i} loss")


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
def test_scanned_rewritten_step_equals_the_per_step_program(case):
    state, opt_state, losses = case.scan(canonical_conv_dimensions(case.step))
    final_state, final_opt_state = case.trajectory[-1][:2]
    assert_to_rounding(state, final_state, "state after the scan")
    assert_to_rounding(opt_state, final_opt_state, "opt_state after the scan")
    np.testing.assert_allclose(losses, [t[2] for t in case.trajectory], **ACROSS_PROGRAMS)


@pytest.mark.slow  # over ~5 s on 2 cores: the fast lane's 5 minutes on CI's machine
def test_batchnorm_and_dropout_state_moves_every_step():
    """The comparisons are only worth something if the carried state moves: batch
    statistics and RNG counts change every step (and the dropout masks with them)."""
    case = case_of("tutorial_bn_dropout")
    states = [case.state] + [t[3] for t in case.trajectory]
    for kind in (nnx.BatchStat, nnx.RngCount):
        arrays = [state_arrays(nnx.split_state(s, kind, ...)[0]) for s in states]
        assert arrays[0], kind
        for before, after in itertools.pairwise(arrays):
            assert not any(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.slow
def test_scan_of_small_batchnorm_model_is_close():
    """XLA:CPU fuses the rest of a loop body on its own terms, and it contracts a*b+c into
    an FMA where fusion puts them side by side: for this model, even on a CPU where the
    jitted rewritten step is bitwise the untouched one, in the scan Adam's moment update
    fuses differently from the second step on (last-bit differences; the untouched scan
    differs too)."""
    case = Case(*SMALL_BN)
    rewritten = jax.jit(canonical_conv_dimensions(case.step), static_argnums=0)
    for got, want in zip(case.run_per_step(rewritten), case.trajectory, strict=True):
        assert_to_rounding(got[0], want[0], "jitted step")
    state, _, losses = case.scan(canonical_conv_dimensions(case.step))
    for a, b in zip(state, case.trajectory[-1][0], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(losses, [t[2] for t in case.trajectory], rtol=1e-6)


# -- what is rewritten, and where ---------------------------------------------------------------


def conv_equations(jaxpr) -> list:
    """Every conv_general_dilated equation of a jaxpr and the jaxprs nested in it."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "conv_general_dilated":
            found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += conv_equations(sub)
    return found


def is_canonical(eqn) -> bool:
    numbers = eqn.params["dimension_numbers"]
    d = len(numbers.lhs_spec) - 2
    batch_features = (0, d + 1, *range(1, d + 1))
    return (
        numbers.lhs_spec == batch_features
        and numbers.out_spec == batch_features
        and numbers.rhs_spec == (d + 1, d, *range(d))
    )


def conv_net(w, x):
    """A convolution of each layout, in every kind of nested jaxpr."""
    nchw = functools.partial(lax.conv_general_dilated, dimension_numbers=("NCHW", "OIHW", "NCHW"))

    @jax.jit
    def jitted(x):
        return jnp.tanh(nchw(x, w, (1, 1), "SAME"))

    @jax.checkpoint
    def remat(x):
        return jnp.sin(nchw(x, w, (1, 1), "SAME"))

    @jax.custom_vjp
    def custom(x, w):
        return nchw(x, w, (1, 1), "SAME")

    def custom_bwd(saved, g):  # its convolutions land in the gradient's jaxpr
        return jax.vjp(lambda x, w: nchw(x, w, (1, 1), "SAME"), *saved)[1](g)

    custom.defvjp(lambda x, w: (custom(x, w), (x, w)), custom_bwd)

    def body(i, x):
        return jnp.tanh(nchw(x, w, (1, 1), "SAME"))

    x = jitted(x)
    x = remat(x)
    x = lax.cond(x.sum() > 0, lambda x: nchw(x, w, (1, 1), "SAME"), lambda x: x * 2.0, x)
    x = lax.fori_loop(0, 2, body, x)
    x, _ = lax.scan(lambda x, _: (jnp.tanh(nchw(x, w, (1, 1), "SAME")), None), x, None, length=2)
    return jnp.mean(custom(x, w) ** 2)


def nested_inputs():
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.normal(size=(3, 3, 3, 3)) * 0.3, jnp.float32)
    x = jnp.asarray(rng.normal(size=(2, 3, 6, 6)), jnp.float32)
    return w, x


@pytest.mark.slow  # the fast lane's 5 minutes: a long run of its own
def test_every_nested_convolution_is_rewritten_and_equal_to_rounding():
    w, x = nested_inputs()
    step = jax.value_and_grad(conv_net, argnums=(0, 1))
    before = conv_equations(jax.make_jaxpr(step)(w, x))
    with jax.enable_checks(True):  # type-checks the rewritten jaxprs
        after = conv_equations(jax.make_jaxpr(canonical_conv_dimensions(step))(w, x))
    assert not any(map(is_canonical, before)) and len(before) > 10
    assert len(after) == len(before) and all(map(is_canonical, after))
    got = jax.jit(canonical_conv_dimensions(step))(w, x)
    want = jax.jit(step)(w, x)
    # The loops' untouched convolutions take XLA's generic code, the rewritten ones its
    # Eigen kernels: two programs, equal to rounding (1.04e-7 apart on an AMD EPYC).
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, **ACROSS_PROGRAMS)


def test_a_function_without_convolutions_is_left_alone():
    graphdef, state = nnx.split(MLP(rngs=nnx.Rngs(0)))
    tx = optax.adam(1e-2)
    step = make_train_step(xent, tx)
    opt_state = init_opt_state(tx, state)
    batch = jax.tree.map(lambda x: x[:8], make_data(8))
    args = (graphdef, state, opt_state, batch)
    assert str(jax.make_jaxpr(canonical_conv_dimensions(step), static_argnums=0)(*args)) == str(
        jax.make_jaxpr(step, static_argnums=0)(*args)
    )


def test_a_canonical_forward_convolution_is_left_alone():
    w, x = jnp.ones((3, 3, 2, 4)), jnp.ones((2, 6, 6, 2))
    conv = functools.partial(
        lax.conv_general_dilated, window_strides=(1, 1), padding="SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )  # fmt: skip
    jaxpr = jax.make_jaxpr(canonical_conv_dimensions(conv))(x, w)
    assert [e.primitive.name for e in jaxpr.eqns] == ["conv_general_dilated"]


# -- under other transforms -------------------------------------------------------------------


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
def test_under_vmap_over_stacked_models():
    """vmap batches the (rewritten) convolution into a grouped one: close, not promised
    bitwise (the batching rule runs on other dimension numbers than the untouched step's)."""
    nodes, tx, _ = MODELS["tutorial_cnn"]
    graphdef, state = nnx.split(nodes(0))
    states = jax.tree.map(lambda *xs: jnp.stack(xs), state, nnx.split(nodes(1))[1])
    opt_states = jax.vmap(lambda s: init_opt_state(tx, s))(states)
    step = make_train_step(image_xent, tx)
    batch = jax.tree.map(lambda x: x[0], digits_like(1))

    def vmapped(step):
        return jax.jit(jax.vmap(lambda s, o: step(graphdef, s, o, batch)))

    got = vmapped(canonical_conv_dimensions(step))(states, opt_states)
    want = vmapped(step)(states, opt_states)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # over ~7 s: the fast lane stays under 5 minutes on 2 cores
def test_under_an_outer_grad():
    """jax.grad of a rewritten loss: the outer gradient's own convolutions are not rewritten
    (they do not exist when the loss is traced); rewriting the gradient function itself
    rewrites them all. Both equal the untouched gradient to rounding (other programs)."""
    w, x = nested_inputs()
    grad_of_rewritten = jax.jit(jax.grad(canonical_conv_dimensions(conv_net)))
    rewritten_grad = canonical_conv_dimensions(jax.grad(conv_net))
    want = jax.jit(jax.grad(conv_net))(w, x)
    np.testing.assert_allclose(grad_of_rewritten(w, x), want, **ACROSS_PROGRAMS)
    np.testing.assert_allclose(jax.jit(rewritten_grad)(w, x), want, **ACROSS_PROGRAMS)
    jaxpr = jax.make_jaxpr(rewritten_grad)(w, x)
    assert all(map(is_canonical, conv_equations(jaxpr))), "every gradient conv rewritten"
    assert not all(map(is_canonical, conv_equations(jax.make_jaxpr(jax.grad(conv_net))(w, x))))


@pytest.mark.slow  # over ~5 s on 2 cores: the fast lane's 5 minutes on CI's machine
def test_closing_over_a_traced_value():
    w, x = nested_inputs()

    @jax.jit
    def outer(w, x):
        return canonical_conv_dimensions(jax.grad(lambda w: conv_net(w, x)))(w)

    # Another program than the untouched gradient: to rounding (see the module docstring).
    np.testing.assert_allclose(outer(w, x), jax.jit(jax.grad(conv_net))(w, x), **ACROSS_PROGRAMS)


def test_static_leaves_and_keywords_pass_through():
    w, x = nested_inputs()

    def fn(w, x, *, scale, name):
        assert name == "net"  # a string leaf reaches fn as itself
        return conv_net(w, x) * scale

    rewritten = jax.jit(canonical_conv_dimensions(fn), static_argnames="name")
    out = rewritten(w, x, scale=2.0, name="net")
    np.testing.assert_allclose(out, jax.jit(conv_net)(w, x) * 2.0, **ACROSS_PROGRAMS)


def test_a_wrapped_jitted_function_compiles_once(compile_count):
    """Wrapping a jax.jit-ed function reuses jit's trace, and the same rewritten program,
    so calling it again (outside any jit) compiles nothing."""
    w, x = nested_inputs()
    w2 = jax.block_until_ready(w * 1.5)
    grad = jax.jit(jax.grad(conv_net))
    rewritten = canonical_conv_dimensions(grad)
    first = rewritten(w, x)
    compiled = compile_count()
    again = rewritten(w2, x)
    assert compile_count() == compiled
    # The rewritten program against the untouched one: to rounding (module docstring).
    np.testing.assert_allclose(first, grad(w, x), **ACROSS_PROGRAMS)
    np.testing.assert_allclose(again, grad(w2, x), **ACROSS_PROGRAMS)


def test_rejects_a_non_function():
    with pytest.raises(TypeError, match="takes a function"):
        canonical_conv_dimensions(3)
