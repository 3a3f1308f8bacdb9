"""Device values read on the host: what logs, the progress line and evaluation print."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def to_host(tree: Any) -> Any:
    """``jax.device_get`` that also reads replicated arrays spanning several processes."""

    def get(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(x.addressable_shards[0].data)
        return x

    return jax.device_get(jax.tree.map(get, tree))
