"""Chaos: a training script killed at random moments and rerun with the same command ends
bitwise where a run that was never interrupted ends.

``chaos_worker.py`` trains 6 epochs of 25 steps with ``resume=True`` and a checkpoint every
4 steps (each call of 4 steps paced to take at least ``PACE_S``), and reports on stdout
when it is ready to call ``fit``, when ``fit``'s loop begins and the global step after
every compiled call. The reference is the same command run once, uninterrupted, in a
directory of its own.

When the signals land: a kill drawn from the whole length of an uninterrupted run ends the
run within three or four kills, since each rerun keeps what the last one saved. So the
kill points are global steps drawn over the first three quarters of the run (in order):
each rerun is killed within ``AFTER_CALL_S`` of reporting the call that reached its step —
in the save after that call, in the next calls, or between epochs — whatever the machine's
speed, and the worker is still running at the last one. Two attempts instead kill during
the restore, the compile or the first call, timed from the "ready" line.

Every draw comes from ``random.Random(0)``; the test waits on no fixed sleep (the waits are
for a line from the worker, or ``Popen.wait`` with a timeout), and the SIGKILL test takes
no more kills beyond the fifth when its time budget runs low.

Each rerun costs a process start (imports, a restore, programs read from the compilation
cache), so the kills are few: what is proven — every kill survived, checkpoints never
going back, the final state bitwise the uninterrupted one's — does not grow with their
number. The run stays long (steps are cheap next to a process start), so that a rerun
killed at its target is still training.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time

import chaos_worker
import numpy as np
import pytest

# The slow lane (pyproject.toml): every test kills and reruns processes. The fast lane's
# cousins: test_checkpoint_adapter's save killed midway, the in-process reruns of
# test_long_runs and test_population_engine, the in-process SIGTERM tests.
pytestmark = pytest.mark.slow

WORKER = str(pathlib.Path(__file__).with_name("chaos_worker.py"))
STEPS_PER_EPOCH = chaos_worker.EXAMPLES // chaos_worker.BATCH
TOTAL_STEPS = chaos_worker.EPOCHS * STEPS_PER_EPOCH
STARTUP_TIMEOUT_S = 60  # imports and compiles on a busy 2-core machine
# A signal lands up to this long after a call's report: less than the last quarter of the
# run takes (9 calls or more of at least chaos_worker.PACE_S each).
AFTER_CALL_S = 0.08


def env() -> dict:
    clean = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**clean, "JAX_PLATFORMS": "cpu"}


class Worker:
    """One run of the worker script; its stdout lines arrive, timestamped, on a queue."""

    def __init__(
        self,
        checkpoint_dir: pathlib.Path,
        out: pathlib.Path,
        cache: pathlib.Path,
        mode: str = "trainer",
    ):
        self.stderr_path = out.with_suffix(f".{time.monotonic_ns()}.stderr")
        self.started = time.monotonic()
        self.started_wall = time.time()
        # stderr goes to a file (a full pipe would block the worker); the child keeps its
        # own copy of the descriptor.
        with open(self.stderr_path, "w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, WORKER, str(checkpoint_dir), str(out), str(cache), mode],
                stdout=subprocess.PIPE, stderr=stderr, text=True, env=env(),
            )  # fmt: skip
        self._lines: queue.Queue = queue.Queue()
        self.seen: dict[str, float] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put((time.monotonic(), line.strip()))
        self._lines.put((time.monotonic(), None))

    def wait_for(self, word: str, timeout: float) -> float | None:
        """When the worker printed ``word``; None if it ended without printing it."""
        if word in self.seen:
            return self.seen[word]
        return self._wait(lambda line: line == word, word, timeout)

    def wait_for_step(self, step: int, timeout: float) -> float | None:
        """When the worker reported a call that reached ``step`` or beyond; None if it
        ended first."""
        return self._wait(
            lambda line: line.startswith("step ") and int(line.split()[1]) >= step,
            f"step {step}", timeout,
        )  # fmt: skip

    def _wait(self, match, what: str, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                when, line = self._lines.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                self.stop()
                pytest.fail(f"no {what!r} from the worker in {timeout} s:\n{self.stderr()}")
            if line is None:
                self._lines.put((when, None))  # later calls see the end too
                return None
            self.seen.setdefault(line, when)
            if match(line):
                return when

    def signal_after(self, delay: float, signum: int) -> bool:
        """Sends ``signum`` ``delay`` s from now unless the worker ends first; True when
        the signal reached a running worker."""
        try:
            self.proc.wait(timeout=delay)
            return False
        except subprocess.TimeoutExpired:
            pass
        self.proc.send_signal(signum)
        code = self.finish(30)
        # A worker that exited between the timeout and the signal is not counted.
        return code == -signum if signum == signal.SIGKILL else code != 0

    def finish(self, timeout: float) -> int:
        """Waits for the worker to end; returns its exit status."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"the worker did not end in {timeout} s:\n{self.stderr()}")
        self._reader.join(timeout=10)  # the rest of stdout, up to its end
        while not self._lines.empty():
            when, line = self._lines.get()
            if line is not None:
                self.seen.setdefault(line, when)
        return self.proc.returncode

    def ended_early(self, target: int, directory: pathlib.Path) -> str:
        code = self.finish(30)
        return (
            f"the worker ended (exit {code}) before step {target}, after printing "
            f"{list(self.seen)}; checkpoints {checkpoint_steps(directory)}\n{self.stderr()}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stderr(self) -> str:
        return self.stderr_path.read_text()[-4000:]


def checkpoint_steps(directory: pathlib.Path) -> list[int]:
    """The finished checkpoints in ``directory``: orbax names each by its step, and a save
    in progress by a temporary name."""
    if not directory.exists():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def saves_in_progress(directory: pathlib.Path, since: float = 0.0) -> list[str]:
    """Unfinished saves (orbax's temporary folders), begun at wall time ``since`` or later
    (a rerun removes one only when it saves that step again)."""
    if not directory.exists():
        return []
    return [p.name for p in directory.iterdir() if "tmp" in p.name and p.stat().st_mtime >= since]


def load(path: pathlib.Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def assert_same_final_state(got: dict, reference: dict) -> None:
    """Every array of the model and optax state bitwise, the counters, and the History
    (its losses are reductions XLA may fuse differently in calls of another length: they
    agree to the last bits)."""
    ended = (int(got["step"]), int(got["epoch"]))
    assert ended == (TOTAL_STEPS, chaos_worker.EPOCHS), f"the rerun ended at (step, epoch) {ended}"
    np.testing.assert_array_equal(got["history_epochs"], np.arange(chaos_worker.EPOCHS))
    assert sorted(got) == sorted(reference)
    for name, value in reference.items():
        if name == "history_losses":
            np.testing.assert_allclose(got[name], value, rtol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], value, err_msg=name)


def run_to_completion(directory, out, cache, mode="trainer") -> tuple[Worker, float]:
    worker = Worker(directory, out, cache, mode)
    code = worker.finish(STARTUP_TIMEOUT_S + 60)
    assert code == 0, worker.stderr()
    assert "done" in worker.seen, worker.seen
    return worker, time.monotonic() - worker.started


def kill_steps(rng: random.Random, count: int, below: int = TOTAL_STEPS * 3 // 4) -> list[int]:
    """``count`` global steps in 1 .. ``below`` - 1, one drawn in each of ``count`` equal
    slices (so that a few kills still spread over the run), in order. A step a rerun has
    already passed is signalled right after that rerun's first call."""
    edges = [1 + i * (below - 1) // count for i in range(count + 1)]
    return [rng.randrange(lo, hi) for lo, hi in itertools.pairwise(edges)]


class Reference:
    """The uninterrupted run: its final state, and how long it took."""

    def __init__(self, root: pathlib.Path, mode: str = "trainer"):
        self.mode = mode
        self.cache = root / "jax-cache"  # shared by every rerun: none of them compiles
        out = root / "reference.npz"
        _, self.total_s = run_to_completion(root / "checkpoints", out, self.cache, mode)
        self.arrays = load(out)
        assert int(self.arrays["step"]) == TOTAL_STEPS, "the reference did not finish"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Reference:
    return Reference(tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module", params=["trainer", "population"])
def any_reference(request, reference, tmp_path_factory) -> Reference:
    """A Trainer's run, and a Population's: one fit engine, one preemption path."""
    if request.param == "trainer":
        return reference
    return Reference(tmp_path_factory.mktemp("population"), "population")


KILLS = 6  # planned; at least MIN_KILLS must land (the budget may cut the last ones)
MIN_KILLS = 5
EARLY = (1, 4)  # these attempts kill during the restore, the compile or the first call
BUDGET_S = 40


def test_a_run_killed_at_random_moments_and_rerun_ends_bitwise_like_an_uninterrupted_one(
    any_reference, tmp_path
):
    reference, mode = any_reference, any_reference.mode
    rng = random.Random(0)
    targets = kill_steps(rng, KILLS - len(EARLY))
    directory, out = tmp_path / "checkpoints", tmp_path / "final.npz"
    start = time.monotonic()
    kills, resumes, mid_save, before_first_call = 0, 0, 0, 0
    latest_seen = []  # the newest checkpoint before each launch
    killed_at = []  # the newest checkpoint right after each kill
    startup_s = 0.5  # "ready" to the first call's end, measured on each targeted rerun
    while kills < KILLS:
        if kills >= MIN_KILLS and time.monotonic() - start > BUDGET_S - 2 * reference.total_s:
            break  # keep the time for the final rerun
        steps = checkpoint_steps(directory)
        latest_seen.append(steps[-1] if steps else None)
        resumes += bool(steps)
        worker = Worker(directory, out, reference.cache, mode)
        ready = worker.wait_for("ready", STARTUP_TIMEOUT_S)
        assert ready is not None, worker.stderr()
        if kills in EARLY:
            delay = rng.uniform(0.0, startup_s)
        else:
            target = targets.pop(0)
            first = worker.wait_for_step(0, STARTUP_TIMEOUT_S)
            if first is None or worker.wait_for_step(target, STARTUP_TIMEOUT_S) is None:
                pytest.fail(worker.ended_early(target, directory))
            startup_s = first - ready
            delay = rng.uniform(0.0, AFTER_CALL_S)
        if not worker.signal_after(delay, signal.SIGKILL):
            pytest.fail(f"the worker ended before the kill (exit {worker.proc.returncode})")
        kills += 1
        before_first_call += not any(line.startswith("step ") for line in worker.seen)
        mid_save += bool(saves_in_progress(directory, since=worker.started_wall))
        steps = checkpoint_steps(directory)
        killed_at.append(steps[-1] if steps else None)

    _, final_s = run_to_completion(directory, out, reference.cache, mode)
    print(
        f"\nchaos (SIGKILL, {mode}): {kills} kills survived, {resumes} reruns resumed from a "
        f"checkpoint, {mid_save} kills left a save half-written, {before_first_call} landed "
        f"before the rerun's first call ended; newest checkpoint after each kill: "
        f"{killed_at}; the final rerun took {final_s:.1f} s, the uninterrupted run "
        f"{reference.total_s:.1f} s; {time.monotonic() - start:.1f} s in all"
    )
    assert_same_final_state(load(out), reference.arrays)
    assert kills >= MIN_KILLS
    seen = [s for s in latest_seen if s is not None]
    assert seen == sorted(seen), f"a checkpoint went back: {latest_seen}"
    # Of the 5 reruns, the 2 killed early may save nothing new; the others each reach a
    # slice of their own: at least 3 distinct.
    assert len(set(seen)) >= 3, f"the reruns made too little progress: {latest_seen}"


TERMS = 3


def test_sigterm_saves_and_raises_preempted_and_the_rerun_ends_bitwise(reference, tmp_path):
    rng = random.Random(0)
    # The last SIGTERM comes as soon as the call that ends an epoch at a multiple of
    # checkpoint_every_steps reports: the save there is a step AND an epoch checkpoint.
    both = next(
        e * STEPS_PER_EPOCH
        for e in range(1, chaos_worker.EPOCHS)
        if e * STEPS_PER_EPOCH % chaos_worker.EVERY_STEPS == 0
    )
    targets = [*kill_steps(rng, TERMS - 1, below=both - 8), both]
    delays = [*(rng.uniform(0.0, AFTER_CALL_S) for _ in targets[1:]), 0.0]
    directory, out = tmp_path / "checkpoints", tmp_path / "final.npz"
    start = time.monotonic()
    preempted_at = []
    for target, delay in zip(targets, delays, strict=True):
        worker = Worker(directory, out, reference.cache)
        # SIGTERM is fit's to handle once its loop runs (its first call ended, here).
        if worker.wait_for_step(target, STARTUP_TIMEOUT_S) is None:
            pytest.fail(worker.ended_early(target, directory))
        assert worker.signal_after(delay, signal.SIGTERM), worker.stderr()
        stderr = worker.stderr()
        assert worker.proc.returncode == 1, stderr  # an uncaught exception, not the signal
        assert "Preempted: fit stopped on signal SIGTERM" in stderr, stderr
        step = int(re.search(r"a checkpoint at step (\d+) holds everything", stderr)[1])
        assert step >= target
        assert checkpoint_steps(directory)[-1] == step, (checkpoint_steps(directory), step)
        assert not saves_in_progress(directory)  # the save finished before the exception
        assert "done" not in worker.seen
        preempted_at.append(step)

    _, final_s = run_to_completion(directory, out, reference.cache)
    print(
        f"\nchaos (SIGTERM): {len(preempted_at)} preemptions, saved at steps {preempted_at} "
        f"(sent at steps {targets}); the final rerun took {final_s:.1f} s; "
        f"{time.monotonic() - start:.1f} s in all"
    )
    assert preempted_at == sorted(preempted_at)
    assert_same_final_state(load(out), reference.arrays)


def test_a_fused_run_killed_or_preempted_at_random_moments_ends_bitwise(reference, tmp_path):
    """Epochs that save fuse (chaos_worker's ``fused`` mode: a fused call keeps the states
    of its saves, written after it as one batch): SIGKILLs and SIGTERMs at random moments
    of the rerun's training, then a rerun to the end, give bitwise the uninterrupted run's
    state and its History. A SIGTERM lets the call in flight finish, saves and raises."""
    rng = random.Random(1)
    cache = reference.cache  # the programs of the other modes' runs are no use here
    ref_out = tmp_path / "reference.npz"
    run_to_completion(tmp_path / "compiles", ref_out, cache, "fused")  # fills the cache
    ref, _ = run_to_completion(tmp_path / "reference", ref_out, cache, "fused")
    train_s = max(ref.seen["done"] - ref.seen["training"], 0.05)  # as a rerun trains
    directory, out = tmp_path / "checkpoints", tmp_path / "final.npz"
    landed, latest = [], []
    for signum in (signal.SIGKILL, signal.SIGTERM, signal.SIGKILL, signal.SIGTERM):
        worker = Worker(directory, out, cache, "fused")
        if worker.wait_for("training", STARTUP_TIMEOUT_S) is None:  # nothing left to train
            assert worker.finish(30) == 0 and "done" in worker.seen, worker.stderr()
            break
        if not worker.signal_after(rng.uniform(0.0, train_s), signum):
            assert worker.proc.returncode == 0, worker.stderr()
            break  # it finished first: nothing left to interrupt
        if worker.proc.returncode == 1:  # a SIGTERM fit handled (else it came after fit)
            assert "Preempted: fit stopped on signal SIGTERM" in worker.stderr(), worker.stderr()
            assert not saves_in_progress(directory)
        landed.append(signal.Signals(signum).name)
        steps = checkpoint_steps(directory)
        latest.append(steps[-1] if steps else None)
    run_to_completion(directory, out, cache, "fused")
    print(f"\nchaos (fused): {landed} landed in {train_s:.2f} s of training; the newest "
          f"checkpoint after each: {latest}")  # fmt: skip
    got, want = load(out), load(ref_out)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    seen = [s for s in latest if s is not None]
    assert seen == sorted(seen), f"a checkpoint went back: {latest}"
