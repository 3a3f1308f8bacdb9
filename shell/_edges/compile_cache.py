"""Opt-in persistent compilation cache: a second process reuses the first one's compiles."""

from __future__ import annotations

import os
import pathlib

DEFAULT_DIR = "~/.cache/nnxscan/jax"


def enable_compilation_cache(path: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Turns on JAX's persistent compilation cache in ``path`` (created if missing).

    Every XLA program compiled from then on is written to ``path`` and, in a later
    process, read back instead of compiled again: a script run twice compiles once. It
    sets JAX's global configuration (``jax_compilation_cache_dir`` and the thresholds,
    lowered so that the CPU's short compiles are cached too), so it is a call you make,
    never a side effect of importing nnxscan. Entries are keyed by the program, the
    backend and the JAX version: a stale entry is never used.

    Args:
      path: the cache folder; default ``~/.cache/nnxscan/jax``.

    Returns:
      The absolute path of the cache folder.

    Example:
      >>> enable_compilation_cache("/tmp/jax-cache")
      PosixPath('/tmp/jax-cache')
    """
    # Imported here: the CLI reads DEFAULT_DIR for its --help, which must not wait for jax.
    import jax

    folder = pathlib.Path(path if path is not None else DEFAULT_DIR).expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder
