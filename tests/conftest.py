"""Shared small models, data and the independent reference: the plain per-step NNX loop."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import shutil
import signal
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

# -- on an accelerator -------------------------------------------------------------------------
# The suite's references are float32 formulas and per-step loops: on a TPU, JAX's default
# precision multiplies float32 in bfloat16 passes (~3 digits; ~7 at "highest", see
# docs/performance.md), so a run on an accelerator compares at "highest". Subprocesses of a
# test need no chip, and one process holds it at a time there: they get the CPU. Nothing
# changes on the CPU, where CI runs.
if jax.default_backend() != "cpu":
    jax.config.update("jax_default_matmul_precision", "highest")
    os.environ["JAX_PLATFORMS"] = "cpu"  # read by subprocesses; this one's backend is up


# A test marked ``slow_on_accelerator(reason)`` is in the fast lane on the CPU and in the
# slow lane on any other backend, where it still runs (``pytest -m slow``), never skipped.
# The fast lane must pass in one process in under 10 minutes on a TPU v5e (issue 57), where
# every XLA compile and every eager op costs several times the CPU's: the tests marked so
# took 4-41 s each there (the reason on each mark says what costs), ~220 s of ~690.
def lane_for_backend(items, backend: str) -> int:
    """Adds ``slow`` to the items marked ``slow_on_accelerator`` when ``backend`` is not the
    CPU; returns how many it moved. Conftest's own, tested in test_conftest_lanes.py."""
    moved = 0
    for item in items:
        mark = item.get_closest_marker("slow_on_accelerator")
        if mark is None:
            continue
        if not (mark.args and isinstance(mark.args[0], str) and mark.args[0].strip()):
            raise pytest.UsageError(f"{item.nodeid}: slow_on_accelerator needs a reason.")
        if backend != "cpu":
            item.add_marker(pytest.mark.slow)
            moved += 1
    return moved


@pytest.hookimpl(tryfirst=True)  # before pytest's -m deselects by the markers
def pytest_collection_modifyitems(config, items):
    lane_for_backend(items, jax.default_backend())


# -- one compilation cache for the run --------------------------------------------------------
# Many tests compile programs another test compiled already (the same small model, loss and
# shapes in another Trainer: the same XLA program). JAX's persistent compilation cache, in a
# folder made for this run and removed after it, compiles each such program once per
# process. Each xdist worker writes its own subfolder: JAX writes an entry without a lock,
# and an entry read while another process writes it is a warning ("Error reading persistent
# compilation cache entry") that a test which turns warnings into errors would fail on,
# depending on timing. (One folder shared by both workers took the fast lane's CPU time
# 11.5 -> 9.3 min on 2 cores; a folder each, 11.5 -> 10.9 min, one run at load ~5. On an
# accelerator, where the suite runs in one process and compiles cost more, it gains more.)
# A program loaded from the cache is the one compiled, and ``compile_count`` counts a load
# as a compile (JAX reports ``backend_compile_duration`` for both), so no test depends on
# which test ran first. A user's own
# JAX_COMPILATION_CACHE_DIR is left alone; NNXSCAN_TEST_COMPILATION_CACHE is this file's
# (set by the run's first process for its xdist workers); "off" turns the cache off.
_CACHE_ENV = "NNXSCAN_TEST_COMPILATION_CACHE"


def pytest_configure(config):
    folder = os.environ.get(_CACHE_ENV)
    if folder is None and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        folder = tempfile.mkdtemp(prefix="nnxscan-tests-jax-cache-")
        os.environ[_CACHE_ENV] = folder  # xdist's workers start after this: they inherit it
        config._nnxscan_compilation_cache = folder  # made here: removed here
    if folder and folder != "off":
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        jax.config.update("jax_compilation_cache_dir", os.path.join(folder, worker))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    folder = getattr(config, "_nnxscan_compilation_cache", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(_CACHE_ENV, None)


@contextlib.contextmanager
def float64_checks():
    """float64 for a finite-difference check, on the CPU: there float64 is native, where a
    TPU emulates it (and XLA:TPU fails to lower float64 ``truncated_normal`` inits, jax
    0.10.2). On the CPU backend this is ``jax.enable_x64(True)`` alone."""
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        yield


# -- a worker's exit ---------------------------------------------------------------------------
# An xdist worker reports its results when its session finishes; execnet then gives it 5 s to
# exit and, past them, sends it SIGINT (execnet's ``_terminate_execution``). What a worker
# does after reporting is mostly pytest's last garbage collections, each walking every live
# object of a long session (jit caches, arrays) and running JAX's gc callback
# (``jax._src.lib._xla_gc_callback``); on a loaded machine they took longer than 5 s, and the
# SIGINT's KeyboardInterrupt surfaced inside that callback, which Python reports as an
# unraisable exception: the intermittent ``PytestUnraisableExceptionWarning: ...
# _xla_gc_callback ... KeyboardInterrupt`` before the summary. Nothing failed. So a worker
# collects its garbage while the controller still waits for its results, and freezes what
# lives on (``gc.freeze``: later collections skip it), leaving those last collections little
# to walk.


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput"):  # runs before xdist reports this worker done
        gc.collect()
        gc.freeze()


# -- compile counting -------------------------------------------------------------------------

_COMPILES = {"n": 0}


def _on_event(event: str, *args, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES["n"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler for the test, whatever pytest was started with: a
    background job (``nohup pytest &``) inherits SIGINT ignored, which nnxscan rightly
    leaves alone; a test that sends SIGINT needs the default, and gets the old one back."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def stretch_count(monkeypatch):
    """``stretch_count()`` returns how many compiled stretches (``run_calls``: one epoch, or
    several fused) fit has run since the test started."""
    import nnxscan.shell._engine.fit as fit_module

    stretches = []
    real = fit_module.run_calls

    def counted(*args, **kwargs):
        stretches.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fit_module, "run_calls", counted)
    return lambda: len(stretches)


@pytest.fixture
def compile_count():
    """``compile_count()`` returns the number of XLA compilations since the test started."""
    start = _COMPILES["n"]
    return lambda: _COMPILES["n"] - start


# -- models -------------------------------------------------------------------------------------


class MLP(nnx.Module):
    def __init__(self, din: int = 4, hidden: int = 8, dout: int = 3, *, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(din, hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


class BNDropout(nnx.Module):
    """Forward pass mutates batch statistics and RNG counts."""

    def __init__(self, din: int = 4, hidden: int = 8, dout: int = 3, *, rngs: nnx.Rngs):
        # No bias before BatchNorm: its gradient is pure rounding noise, which Adam would
        # amplify into lr-sized steps and make equal-up-to-rounding runs diverge.
        self.l1 = nnx.Linear(din, hidden, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(hidden, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.l2 = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


class SmallCNN(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
        self.out = nnx.Linear(4 * 8 * 8, 3, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.conv(x))
        return self.out(h.reshape(h.shape[0], -1))


def run_together(commands: list[list[str]], timeout: float, **popen) -> list[tuple]:
    """Starts every command at once (pipes for stdout and stderr, text mode) and returns
    each one's ``(process, stdout, stderr)``; all are killed if a wait times out or is
    interrupted, so no process outlives the test."""
    procs = [
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
        )
        for command in commands
    ]
    try:
        results = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p, out, err) for p, (out, err) in zip(procs, results, strict=True)]


def xent(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def xent_aux(model, batch):
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"acc": jnp.mean(logits.argmax(-1) == batch["y"])}


def accuracy(model, batch):
    return jnp.mean(model(batch["x"]).argmax(-1) == batch["y"])


def make_data(n: int = 64, din: int = 4, classes: int = 3, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, din)).astype(np.float32)
    w = rng.normal(size=(din, classes))
    return {"x": x, "y": np.argmax(x @ w, axis=-1).astype(np.int32)}


@pytest.fixture(scope="session")
def data():
    return make_data()


# -- the independent reference ------------------------------------------------------------------


@functools.cache
def _reference_step(loss_fn, wrt, has_aux: bool):
    """The reference's jitted step, one per ``(loss_fn, wrt, has_aux)``: a fresh ``nnx.jit``
    function per call would recompile for every test, even on the same graphdef and shapes."""

    @nnx.jit
    def train_step(model, optimizer, batch):
        diff = nnx.DiffState(0, wrt)
        out, grads = nnx.value_and_grad(loss_fn, argnums=diff, has_aux=has_aux)(model, batch)
        optimizer.update(model, grads)
        return out

    return train_step


def reference_loop(model, optimizer, loss_fn, batches: list, has_aux: bool = False):
    """The plain per-step NNX loop: ``nnx.jit`` + ``nnx.value_and_grad`` + ``optimizer.update``."""
    train_step = _reference_step(loss_fn, optimizer.wrt, bool(has_aux))
    return [train_step(model, optimizer, b) for b in batches]


def epoch_batches(data: dict, batch_size: int, seed: int, epoch: int, shuffle: bool = True):
    """The documented shuffle rule: numpy's default_rng((seed, epoch)).permutation(n), with
    the examples left over by the last full batch dropped."""
    n = len(data["x"])
    order = np.random.default_rng((seed, epoch)).permutation(n) if shuffle else np.arange(n)
    nb = n // batch_size
    return [
        {k: v[order[i * batch_size : (i + 1) * batch_size]] for k, v in data.items()}
        for i in range(nb)
    ]


def state_arrays(node) -> list[np.ndarray]:
    """Host copies of every array in a module or state (RNG keys as their raw data)."""
    out = []
    for leaf in jax.tree.leaves(nnx.state(node) if isinstance(node, nnx.Pytree) else node):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out.append(np.array(leaf))
    return out


# Bitwise, or to rounding? The same compiled program on the same inputs gives the same bits
# on every machine (a resumed run whose calls are the uninterrupted run's, two processes).
# So does the same LOOP BODY compiled into two programs: the step as the body of nnxscan's
# lax.scan (fit, make_epoch, scan_steps, scan_train, populations), whatever feeds it the
# batches (gathered whole or in chunks, sliced, streamed) and however many steps (2 or
# more) a call runs. Their optimized HLO bodies were checked to do the same arithmetic
# (the small MLP, BatchNorm + Dropout): XLA:CPU then picks the same kernels on any CPU.
# Everything else is another program and agrees only to rounding: a per-step program (the
# step in the entry computation, which XLA:CPU fuses unlike a loop body; a scan of ONE
# step is no loop, XLA inlines it), a hand-written or Flax's own loop, vmapped members, a
# rewritten convolution. XLA:CPU picks kernels per CPU model, so such programs can be equal
# on one CPU and not on another (the convolution layout pass's gradient: bitwise on CI's
# CPU, 1e-7 apart on an AMD EPYC). Over the few steps of a small model the tests run, such
# differences stay within these bounds, with room for Adam's normalized steps to amplify
# them; a wrong step (a batch out of order, a missed update, another dropout mask) is
# orders of magnitude larger.
ACROSS_PROGRAMS = dict(rtol=1e-5, atol=1e-6)

# On an accelerator the same comparisons hold to wider bounds, even at "highest" matmul
# precision (set above): XLA:TPU's float32 transcendentals and reductions are not numpy's
# float64 ones, and it fuses each program its own way. Measured on a TPU v5e (jax 0.10.2):
# formulas against float64 numpy up to 2.9e-5 absolute / 2.8e-4 relative (a hypernetwork's
# generated weights, values 0.01-2) and 1.4e-6 absolute (a log-probability); the tutorial
# CNN's BatchNorm statistics after 6 Adam steps, per-step against scanned, 1.6e-4 absolute
# on values of 0.005-0.06 (a batch out of order moves them by ~1e-2).
FLOAT32_ON_ACCELERATOR = dict(rtol=1e-3, atol=5e-5)
TRAINED_CNN_ON_ACCELERATOR = dict(rtol=1e-2, atol=5e-4)


def tolerance(rtol: float, atol: float, *, accelerator: dict = FLOAT32_ON_ACCELERATOR) -> dict:
    """``dict(rtol=, atol=)`` on the CPU, where the suite's bounds were set; ``accelerator``
    on any other backend (see above)."""
    return dict(rtol=rtol, atol=atol) if jax.default_backend() == "cpu" else dict(accelerator)


def assert_trees_close(a, b, *, rtol=1e-5, atol=1e-6, exact=False):
    """Every leaf equal, bitwise with ``exact`` (the same program: see above) or else to
    ``rtol``/``atol``; integer leaves (RNG keys and counts, step counters) always exactly."""
    la, lb = state_arrays(a), state_arrays(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        if exact or not np.issubdtype(x.dtype, np.inexact):
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)
