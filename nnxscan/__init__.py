"""nnxscan: train Flax NNX models with ``jax.lax.scan``, and run networks on generated weights.

Its packages are ``nnxscan.pure`` (the functional core), ``nnxscan.shell`` (``Trainer``,
``Population``, ``scan_train``: the imperative shell) and ``nnxscan.adapters`` (edges to
orbax, data loaders, loggers, Linen). Importing ``nnxscan`` imports none of them, nor jax:
``__version__`` is read from the installed distribution's metadata (pyproject.toml's
version) when first asked for.

Example:
  >>> import nnxscan
  >>> nnxscan.__version__
  '0.3.0.dev0'
"""

__all__ = ["__version__"]


def _version() -> str:
    """The installed distribution's version (``nnxscan --version`` prints it too)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("nnxscan")
    except importlib.metadata.PackageNotFoundError:  # imported from a source tree, not installed
        return "0+unknown"


def __getattr__(name: str) -> str:
    # Looked up on first use (PEP 562): importing nnxscan reads no metadata.
    if name == "__version__":
        return _version()
    raise AttributeError(f"module 'nnxscan' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "__version__"])
