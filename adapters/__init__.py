"""nnxscan.adapters: edges to other libraries (nnx.Optimizer, orbax, data loaders, loggers)."""
