"""A population's checkpoints: what :class:`~nnxscan.shell._members.Members` saves, and the
checks a restore makes before anything changes (the seeds, the number of members, the
hyperparameters, a resumed run's ``shared_order``)."""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import numpy as np

from nnxscan.pure.population import injected_values
from nnxscan.shell._members import Members


def save(
    members: Members,
    directory: Any,
    seeds: tuple[int, ...],
    *,
    run: str = "",
    shared_order: bool = False,
    max_to_keep: int = 3,
) -> pathlib.Path:
    """Saves the population as checkpoint number ``members.step`` (replacing one of that
    number: e.g. after EarlyStopping restored the members' best weights)."""
    from nnxscan.adapters.checkpoint import latest_step, save_checkpoint

    path = pathlib.Path(directory).resolve()
    step = members.step
    tree = members.checkpoint_tree(seeds, run, shared_order)
    saved = save_checkpoint(
        path, step, tree, max_to_keep=max_to_keep, replace=latest_step(path) == step
    )
    members.loaded_since_checkpoint = False
    return saved


def restore(
    members: Members,
    directory: Any,
    step: int | None,
    seeds: tuple[int, ...],
    hyperparams: dict[str, list],
    shared_order: bool | None,
) -> int:
    """Reads a checkpoint, checks it against this population, then hands it to ``members``;
    returns the epoch it resumes at."""
    from nnxscan.adapters.checkpoint import restore_checkpoint

    template = members.checkpoint_tree(seeds)
    shardings = members.placement.carry_shardings(members.leaves)
    if shardings is not None:
        # Read straight into the layout training uses (members over their axis).
        carry, treedef = jax.tree.flatten((template["state"], template["opt_state"]))
        abstract = [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
            for x, sh in zip(carry, shardings, strict=True)
        ]
        template["state"], template["opt_state"] = jax.tree.unflatten(treedef, abstract)
    try:
        tree, _ = restore_checkpoint(directory, template, step=step)
    except ValueError as error:
        raise ValueError(
            f"{error} (this population has {len(seeds)} members with seeds "
            f"{list(seeds)}: a checkpoint of another number of members or another "
            f"model does not fit it)"
        ) from None
    meta = tree["meta"]
    saved = tuple(int(s) for s in np.asarray(meta["seeds"]))
    if saved != seeds:
        raise ValueError(
            f"the checkpoint in {directory} holds a population with seeds {list(saved)}, "
            f"this one has {list(seeds)}: build the Population with the seeds it "
            f"was saved with."
        )
    for name, values in hyperparams.items():
        restored = injected_values(tree["opt_state"], name)
        if restored is not None and not np.allclose(restored, values, rtol=1e-6):
            raise ValueError(
                f"the checkpoint's members have {name}="
                f"{[float(f'{v:.6g}') for v in np.asarray(restored)]}, "
                f"this population was built with {list(values)}: build it with the "
                f"hyperparams it was saved with."
            )
    if shared_order is not None and bool(meta["shared_order"]) != bool(shared_order):
        raise ValueError(
            f"resume=True with shared_order={shared_order}, but the checkpoint's run used "
            f"shared_order={bool(meta['shared_order'])}: pass the same to go on with the "
            f"same data orders."
        )
    members.restore(tree)
    return members.epoch
