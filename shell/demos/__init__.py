"""The ``nnxscan demo`` programs: ``digits`` (an MLP on scikit-learn's digits) and
``hypernet`` (one hypernetwork learns a family of functions). They need the ``demo`` extra."""
