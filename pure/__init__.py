"""nnxscan.pure: the functional core.

Pure functions over ``(graphdef, state, opt_state)`` pytrees that compose with every JAX
transform (jit, scan, fori_loop, vmap, grad). No I/O, no clocks, no global state.
"""

from nnxscan.pure.epoch import batch_indices, make_epoch, scan_indexed_steps, take_batch
from nnxscan.pure.evaluation import make_eval_step, make_evaluate
from nnxscan.pure.nonfinite import all_finite, halt_after_nonfinite, tree_select
from nnxscan.pure.scan import scan_loop, scan_steps, shard_batch
from nnxscan.pure.train_step import init_opt_state, make_train_step, split_wrt
from nnxscan.pure.validation import check_batch_size, check_leading_size, check_transform

__all__ = [
    "all_finite",
    "batch_indices",
    "check_batch_size",
    "check_leading_size",
    "check_transform",
    "halt_after_nonfinite",
    "init_opt_state",
    "make_epoch",
    "make_eval_step",
    "make_evaluate",
    "make_train_step",
    "scan_indexed_steps",
    "scan_loop",
    "scan_steps",
    "shard_batch",
    "split_wrt",
    "take_batch",
    "tree_select",
]
