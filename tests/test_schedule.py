"""The schedule (``shell/_engine/schedule.py``): a fit's budget as stretches of calls.

Reference: the plain loop a user writes, one step at a time (``for epoch ...: for step in
its epoch ...``, leaving at the budget). Whatever the schedule fuses or cuts, its stretches
must train exactly that loop's steps in that order, leave the owner where that loop stands,
and count the calls it makes.
"""

from __future__ import annotations

import itertools

import pytest

from nnxscan.shell._engine.plans import Plan
from nnxscan.shell._engine.schedule import (
    FUSED_STEPS,
    SAVED_FUSED_BYTES,
    Saves,
    Schedule,
    with_steps_per_call,
)


def plain_loop(epoch, skip, step, end_epoch, stop_at, per):
    """The (epoch, step of the epoch) pairs a per-step loop trains from where it stands."""
    pairs = []
    for e in itertools.count(epoch) if end_epoch is None else range(epoch, end_epoch):
        for i in range(skip if e == epoch else 0, per):
            if stop_at is not None and step + len(pairs) >= stop_at:
                return pairs
            pairs.append((e, i))
    return pairs


# (epochs, max_steps, whole_run, at=(epoch, epoch_step, step), per_epoch, tail,
#  steps_per_call, fuse, every)
CASES = [
    (3, None, False, (0, 0, 0), 8, False, None, True, None),  # three epochs fused
    (None, 19, False, (0, 0, 0), 8, False, None, True, None),  # two fused, the third cut
    (None, 19, False, (0, 0, 0), 8, False, 3, False, None),  # calls of 3, cut at the budget
    (5, 30, False, (2, 5, 21), 8, False, 4, True, 2),  # a resumed epoch first, then fused
    (6, None, False, (1, 0, 8), 8, False, None, True, 2),  # fused up to each evaluation
    (4, None, False, (0, 0, 0), 7, True, None, True, None),  # a kept short batch: alone
    (2, 10, False, (0, 6, 6), 7, True, 2, True, None),  # resumed just before the short one
    (3, 21, True, (1, 3, 11), 8, False, None, True, None),  # a resume: the whole run's
    (7, None, False, (0, 0, 0), 3000, False, None, True, None),  # at most FUSED_STEPS
    (2, 0, False, (0, 0, 0), 8, False, None, True, None),  # nothing to train
]


@pytest.mark.parametrize("case", CASES)
def test_the_stretches_train_the_plain_loops_steps_and_count_its_calls(case):
    epochs, max_steps, whole_run, at, per, tail, per_call, fuse, every = case
    plan = with_steps_per_call(Plan("scan"), per_call)
    schedule = Schedule.of(epochs, max_steps, whole_run=whole_run, at=at)
    schedule = Schedule(**{**vars(schedule), "per_epoch": per, "tail": tail, "plan": plan,
                           "fuse": fuse, "every": every})  # fmt: skip
    epoch, skip, step = at
    first_epoch, first_step = (0, 0) if whole_run else (epoch, step)
    end = None if epochs is None else first_epoch + epochs
    stop = None if max_steps is None else first_step + max_steps
    want = plain_loop(epoch, skip, step, end, stop, per)

    trained, calls, position, stretches = [], 0, (epoch, skip), []
    for stretch in schedule.stretches():
        assert (stretch.epoch, stretch.skip) == position  # each starts where the last ended
        done = 0
        for start, length in stretch.calls:  # contiguous, each at most steps_per_call long
            assert start == done and 0 < length <= (per_call or length)
            end = stretch.skip + start + length
            assert not tail or end < per or (length == 1 and end == per)  # the short batch
            done += length
        assert done == stretch.steps
        trained += [
            (stretch.epoch + (stretch.skip + k) // per, (stretch.skip + k) % per)
            for k in range(stretch.steps)
        ]
        calls += len(stretch.calls)
        complete = stretch.steps == stretch.ends
        position = stretch.reached(stretch.steps, complete)
        stretches.append(stretch)
    assert trained == want
    # The owner stands where the plain loop would go on.
    after = (want[-1][0], want[-1][1] + 1) if want else (epoch, skip)
    assert position == ((after[0] + 1, 0) if after[1] == per else after)
    total, last_epoch = schedule.progress()
    assert total == calls and last_epoch == (want[-1][0] if want else None)
    for stretch in stretches:
        if stretch.epochs > 1:  # fused: whole epochs that nothing needs the host between
            assert fuse and not tail and stretch.skip == 0 and stretch.steps == stretch.ends
            assert stretch.epochs * per <= max(FUSED_STEPS, per)
            if every is not None:  # evaluation runs after an epoch that ends a stretch
                inside = range(stretch.epoch, stretch.epoch + stretch.epochs - 1)
                assert all((e + 1) % every for e in inside)


def test_a_stream_is_planned_an_epoch_at_a_time_and_cut_at_the_budget_as_it_goes():
    schedule = Schedule.of(3, 10, whole_run=False, at=(0, 2, 0))
    assert schedule.progress() == (None, 2)  # its calls are unknown, its last epoch not
    steps = iter([0, 7, 10])  # the owner's step as each stretch starts
    stretches = list(schedule.stretches(lambda: next(steps)))
    assert [(s.epoch, s.skip, s.steps, s.ends) for s in stretches] == [
        (0, 2, 10, None),
        (1, 0, 3, None),
    ]
    assert stretches[1].reached(2, complete=False) == (1, 2)
    assert stretches[1].reached(3, complete=True) == (2, 0)


def test_a_resume_past_an_epochs_length_is_refused():
    with pytest.raises(ValueError, match="cannot skip 9 steps of a 8-step epoch"):
        Schedule(0, 9, 9, 1, None, per_epoch=8)


@pytest.mark.parametrize(
    ("epochs", "lengths"),
    [(300, [150, 150]), (1000, [200] * 5), (227, [227]), (301, [151, 150])],
)
def test_fused_stretches_past_fused_steps_share_one_length(epochs, lengths):
    """Epochs past FUSED_STEPS run as the fewest stretches of one length where up to twice
    as many share them evenly (each length is a program to compile)."""
    per = FUSED_STEPS // 227  # 44 steps: at most 227 epochs a stretch
    schedule = Schedule(0, 0, 0, epochs, None, per_epoch=per, plan=Plan("scan"), fuse=True)
    assert [s.epochs for s in schedule.stretches()] == lengths


@pytest.mark.parametrize(
    ("epochs", "fused_steps", "lengths"),
    [(6, 16, [2, 2, 2]), (6, 24, [3, 3]), (5, 16, None), (4, 7, [1] * 4), (6, 10**6, [6])],
)
def test_fused_stretches_hold_at_most_fused_steps(epochs, fused_steps, lengths):
    """A source whose gather holds fewer than FUSED_STEPS steps (pure.batching's
    steps_per_gather) caps the epochs fused into one stretch; an epoch longer than the cap
    runs alone (never split for it)."""
    per = 8
    schedule = Schedule(0, 0, 0, epochs, None, per_epoch=per, plan=Plan("scan"), fuse=True,
                        fused_steps=fused_steps)  # fmt: skip
    got = [s.epochs for s in schedule.stretches()]
    assert sum(got) == epochs and max(got) == min(epochs, max(1, fused_steps // per))
    assert lengths is None or got == lengths


@pytest.mark.parametrize(
    ("epoch", "epochs", "every", "keep"),
    [(0, 10, 1, 3), (0, 7, 2, 3), (3, 9, 4, 2), (0, 5, 1, 1), (0, 4, 5, 3), (2, 6, 3, 10)],
)
def test_fused_stretches_that_save_hold_the_states_of_the_saves_the_directory_keeps(
    epoch, epochs, every, keep
):
    """Reference: the saves a loop of one call an epoch makes (every ``every`` epochs) and
    those ``max_to_keep`` leaves of them once the stretch's last is written."""
    saves = Saves(every, keep, carry_bytes=1000)
    schedule = Schedule(epoch, 0, 8 * epoch, epoch + epochs, None, per_epoch=8,
                        plan=Plan("scan"), fuse=True, saves=saves)  # fmt: skip
    (stretch,) = schedule.stretches()
    due = [i for i in range(epochs) if (epoch + i + 1) % every == 0]
    kept = due[-keep:]
    assert stretch.held == tuple(i for i in kept if i != epochs - 1)
    assert [i for i in range(epochs) if stretch.saved(i, every, keep)] == kept


def test_fused_saves_keep_the_steps_times_the_carry_within_a_budget():
    """A fused call that saves holds at most SAVED_FUSED_BYTES of steps times carry bytes
    (a preemption waits for it; the states it keeps fit in it too): a bigger model fuses
    fewer epochs, one of over half the budget none; saves never fuse calls a plan cuts."""

    def lengths(carry_bytes, plan=None):
        plan = plan or Plan("scan")
        schedule = Schedule(0, 0, 0, 40, None, per_epoch=8, plan=plan, fuse=True,
                            saves=Saves(1, 3, carry_bytes))  # fmt: skip
        return [s.epochs for s in schedule.stretches()]

    assert lengths(1000) == [40]
    most = SAVED_FUSED_BYTES // (10 * 2**20) // 8  # epochs of 8 steps of a 10 MiB carry
    assert max(lengths(10 * 2**20)) == most and sum(lengths(10 * 2**20)) == 40
    assert lengths(SAVED_FUSED_BYTES // 2 + 1) == [1] * 40
    assert lengths(1000, with_steps_per_call(Plan("scan"), 4)) == [1] * 40
