"""Run by tests/test_chaos.py in subprocesses (not collected by pytest).

``python chaos_worker.py CHECKPOINT_DIR OUT.npz CACHE_DIR [trainer|population|fused]``: a
preemptible training script on a small model whose forward pass moves batch statistics and
RNG counts (a ``Trainer``, or a ``Population`` of two such members). ``fused``: a Trainer
saving every epoch with nothing else between epochs but an evaluation every
``FUSED_EVAL_EVERY``: its epochs fuse into calls that keep the states their saves need;
it reports only "ready", "training" and "done" (no hook may look between them). It asks for the
WHOLE run with ``resume=True``: rerunning the same command after a kill goes on from the
newest checkpoint. On stdout it reports "ready" just before ``fit`` (imports done, model
built), "training" when ``fit``'s loop begins (after any restore) and "step N" after every
compiled call: what the test times its signals from. Once the run is complete it writes
every array of the final state (and the History) to OUT.npz and prints "done". A SIGTERM
makes ``fit`` save and raise ``Preempted``, which ends the process with a traceback (exit
status 1).
"""

from __future__ import annotations

import sys

EPOCHS, BATCH, EXAMPLES, EVERY_STEPS, SEED = 6, 8, 200, 4, 3  # 25 steps an epoch
# Each compiled call (4 steps) takes at least this long, as a real model's would: the last
# quarter of the run (9 calls or more) then outlasts the test's kill delay, however fast a
# save is on this machine. Timing changes nothing that is trained.
PACE_S = 0.015
# The fused mode: 40 epochs, evaluated every 4 (each evaluation ends a fused call).
FUSED_EPOCHS, FUSED_EVAL_EVERY = 40, 4


def main(checkpoint_dir: str, out: str, cache_dir: str, mode: str = "trainer") -> None:
    import time

    import optax
    from flax import nnx

    from nnxscan.shell import LambdaCallback, Population, Trainer, enable_compilation_cache

    from conftest import BNDropout, accuracy, make_data, xent
    from run_record import save_run

    enable_compilation_cache(cache_dir)
    data = make_data(EXAMPLES)
    fit = {}
    if mode == "population":
        trainer = Population(
            lambda rngs: BNDropout(hidden=16, rngs=rngs), optax.adam(1e-2), xent, seeds=[SEED, 7]
        )
    else:
        model = BNDropout(hidden=16, rngs=nnx.Rngs(0))  # batch statistics and RNG counts move
        trainer = Trainer(model, optax.adam(1e-2), xent)
        fit["seed"] = SEED

    # What the test times its signals from. The hooks change nothing in what is trained: a
    # run with checkpoint_every_steps writes back after every call and fuses no epochs anyway.
    def call_end(trainer, logs):
        print(f"step {logs['step']}", flush=True)
        time.sleep(PACE_S)

    report = LambdaCallback(
        on_train_begin=lambda trainer: print("training", flush=True), on_call_end=call_end
    )
    print("ready", flush=True)
    if mode == "fused":
        history = trainer.fit(
            data, epochs=FUSED_EPOCHS, batch_size=BATCH, checkpoint_dir=checkpoint_dir,
            resume=True, progress=False, eval_data=make_data(40, seed=1), metric_fn=accuracy,
            eval_every=FUSED_EVAL_EVERY, eval_batch_size=40, seed=SEED,
            callbacks=[LambdaCallback(on_train_begin=lambda t: print("training", flush=True))],
        )  # fmt: skip
        save_run(out, model, trainer, history)
        print("done", flush=True)
        return
    history = trainer.fit(
        data, epochs=EPOCHS, batch_size=BATCH, checkpoint_dir=checkpoint_dir,
        checkpoint_every_steps=EVERY_STEPS, resume=True, progress=False,
        callbacks=[report], **fit,
    )  # fmt: skip
    save_run(out, trainer.state if mode == "population" else model, trainer, history)
    print("done", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
