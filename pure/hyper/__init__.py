"""Hypernetworks: run a target network with generated, differentiable parameters.

Example:
  >>> from nnxscan.pure import hyper
  >>> spec = hyper.ParamSpec.from_module(target, wrt=nnx.Param)
  >>> heads = hyper.HyperHeads(spec, 32, rngs=nnx.Rngs(0))
  >>> ys = jax.vmap(lambda h: hyper.call(spec, heads(h), x))(features)  # (n, ...) outputs

- :class:`ParamSpec` (``spec.py``): what is generated, the target's other state, and
  :func:`ravel` / :meth:`ParamSpec.unravel` between params and one flat vector.
- :func:`call` / :func:`call_with_state` (``call.py``): run the target with given params.
- :class:`HyperHeads` (``heads.py``): one linear head per generated tensor, hyperfan-in init.
- :class:`ChunkedHeads` (``chunked.py``): the flat parameter vector chunk by chunk, with one
  shared layer, so the hypernetwork can be smaller than its target.
- :class:`StructuredHeads` (``structured.py``): chunks shaped by the target's layers
  (output units with their whole fan-in).
- ``vector.py``: what the heads share: the generated params as one vector in the heads' own
  order (``heads.vector``, ``heads.params_of``, ``heads.vector_of``;
  ``hnet.generate_vectors()`` for every condition at once).
- :class:`Hypernetwork` (``hypernetwork.py``): trunk + heads + target as one NNX module.
- :class:`ConditionalHypernetwork` (``conditional.py``): one learned embedding per condition
  (task), plus an optional free input.
- :func:`snapshot_generated`, :func:`output_regularizer`, :func:`generated_vectors`,
  :func:`fisher_diagonal` (``continual.py``): von Oswald et al.'s continual-learning
  regularizer, over a sampled subset of earlier tasks or Fisher-weighted.
- :func:`init_moments` (``variance.py``): the init choices of the heads (the target's own
  variance, hyperfan-in, hyperfan-out, zeros).
"""

from nnxscan.pure.hyper.call import call, call_with_state
from nnxscan.pure.hyper.chunked import ChunkedHeads
from nnxscan.pure.hyper.conditional import ConditionalHypernetwork
from nnxscan.pure.hyper.continual import (
    fisher_diagonal,
    generated_vectors,
    output_regularizer,
    snapshot_generated,
)
from nnxscan.pure.hyper.heads import HyperHeads, head_init_scale
from nnxscan.pure.hyper.hypernetwork import FrozenParam, GeneratedSlot, Hypernetwork
from nnxscan.pure.hyper.spec import LeafSpec, ParamSpec, check_params, ravel
from nnxscan.pure.hyper.structured import StructuredHeads
from nnxscan.pure.hyper.variance import INITS, init_moments

__all__ = [
    "INITS",
    "ChunkedHeads",
    "ConditionalHypernetwork",
    "FrozenParam",
    "GeneratedSlot",
    "HyperHeads",
    "Hypernetwork",
    "LeafSpec",
    "ParamSpec",
    "StructuredHeads",
    "call",
    "call_with_state",
    "check_params",
    "fisher_diagonal",
    "generated_vectors",
    "head_init_scale",
    "init_moments",
    "output_regularizer",
    "ravel",
    "snapshot_generated",
]
