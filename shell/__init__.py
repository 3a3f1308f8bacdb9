"""nnxscan.shell: the imperative shell that owns the user's NNX objects.

It compiles the pure core, writes trained state back into the user's ``nnx.Module`` and
``nnx.Optimizer`` with ``nnx.update``, and owns progress, clocks and the command line.
"""

from nnxscan.shell.history import History
from nnxscan.shell.plans import Plan
from nnxscan.shell.scan_train import scan_train
from nnxscan.shell.trainer import Trainer

__all__ = ["History", "Plan", "Trainer", "scan_train"]
