"""ConditionalHypernetwork: one learned embedding per condition (task), plus an optional z.

A task-conditioned hypernetwork (von Oswald et al., ICLR 2020) learns an embedding ``e_c``
for each of ``num_conditions`` conditions, and generates the target's weights from it:
``θ_c = heads(trunk(e_c))``; with ``z_features > 0`` the trunk sees ``[e_c, z]``, so a free
input ``z`` varies the network within a condition. The embeddings are an ordinary
``nnx.Param``, trained with the trunk and the heads.
"""

from __future__ import annotations

from typing import Any, Unpack

import flax.errors
import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from nnxscan.pure import checks
from nnxscan.pure.hyper.hypernetwork import Hypernetwork, HypernetworkOptions
from nnxscan.pure.hyper.spec import path_str
from nnxscan.pure.hyper.vector import EVERY_CONDITION

__all__ = ["ConditionalHypernetwork"]


def _check_trunk(trunk: Any, in_features: int, trunk_features: int) -> None:
    # Shapes only (nothing runs or compiles): a mismatch is named here, not deep in a trace.
    what = (
        f"the trunk must map {in_features} input features (embedding_features + z_features) "
        f"to trunk_features={trunk_features}"
    )
    try:
        out = nnx.eval_shape(lambda t: t(jnp.zeros((in_features,), jnp.float32)), trunk)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{what}, but calling it on {in_features} features failed: {error}") from (
            error
        )
    shape = tuple(getattr(out, "shape", ()))
    if shape[-1:] != (trunk_features,):
        raise ValueError(f"{what}, but it returns shape {shape}. Fix the trunk or trunk_features.")


class ConditionalHypernetwork(Hypernetwork):
    """A :class:`Hypernetwork` whose input is a condition id (and optionally a free ``z``).

    Args:
      target, rngs, **options: as for :class:`Hypernetwork`, whose keyword options
        (``wrt``, ``input_variance``, ``chunk_size``, ``chunk_embedding_features``,
        ``chunk_hidden_features``, ``structured_units``, ``init``, ``init_gain``,
        ``pretrained``, ``freeze_target``) are passed on as given.
      chunk_embeddings: with ``chunk_size`` or ``structured_units``, ``"per_condition"``
        (default): each condition owns its chunk embeddings (hypnettorch's
        ``cond_chunk_embs``), so a task learned
        later need not move what an earlier task's chunks are made from; ``"shared"``: one
        set for every condition (hypnettorch's default). In the guide's continual-learning
        benchmark the shared ones let earlier tasks drift (task 1 down 3 to 25 points);
        per condition, task 1 lost nothing.
      trunk: maps ``embedding_features + z_features`` inputs (``[e_c, z]``) to
        ``trunk_features``; checked on shapes at construction.
      trunk_features: the size of the trunk's output.
      num_conditions: how many conditions (tasks) there are; ids are ``0 ..
        num_conditions - 1``.
      embedding_features: the size of each condition's learned embedding.
      z_features: the size of the free input ``z`` (0, the default: no ``z``).
      embedding_scale: the standard deviation the embeddings are drawn with.
      param_dtype: dtype of the embeddings and of the heads' weights (the trunk's dtype is
        the trunk's own).

    ``hnet.generate(condition, z=None)`` returns the generated params;
    ``hnet(condition, *args, z=None, **kwargs)`` runs the target on ``args`` with them (the
    target's keyword arguments cannot be named ``z``, and ``z`` is passed by keyword only:
    a positional argument after the condition goes to the target). ``condition`` is an int
    or a 0-d integer array; for several conditions at once, ``jax.vmap`` over a 1-D array of
    ids. A concrete id outside ``[0, num_conditions)`` raises; a traced one (under ``jit``
    or ``vmap``) generates NaN weights, so a bad id cannot silently reuse another condition.
    Under ``grad`` a single bad id in a vmapped batch makes *every* gradient of the shared
    weights (trunk, heads) NaN, not only its own row's: check ids before they reach a
    traced step, or wrap the step in ``jax.experimental.checkify`` to raise where it
    happens.

    Attributes:
      embeddings: ``(num_conditions, embedding_features)`` Param.

    Example:
      >>> trunk = nnx.Sequential(nnx.Linear(8, 32, rngs=rngs), nnx.tanh)
      >>> hnet = hyper.ConditionalHypernetwork(target, trunk, 32, num_conditions=5,
      ...                                      embedding_features=8, rngs=rngs)
      >>> y = hnet(2, x)                                        # the network of task 2
      >>> ys = jax.vmap(hnet, in_axes=(0, None))(jnp.arange(5), x)   # all five
    """

    def __init__(
        self,
        target: nnx.Module,
        trunk: Any,
        trunk_features: int,
        *,
        num_conditions: int,
        embedding_features: int,
        z_features: int = 0,
        embedding_scale: float = 1.0,
        chunk_embeddings: str = "per_condition",
        param_dtype: DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
        **options: Unpack[HypernetworkOptions],
    ):
        num_conditions = checks.check_count(num_conditions, "num_conditions", 1)
        if chunk_embeddings not in ("per_condition", "shared"):
            raise ValueError(
                f"chunk_embeddings must be 'per_condition' or 'shared', got {chunk_embeddings!r}."
            )
        # Read by _chunk_tables while the heads are built in Hypernetwork.__init__.
        self.num_conditions = num_conditions
        self.chunk_embeddings = chunk_embeddings
        embedding_features = checks.check_count(embedding_features, "embedding_features", 1)
        z_features = checks.check_count(z_features, "z_features", 0)
        if not embedding_scale > 0:
            raise ValueError(f"embedding_scale must be positive, got {embedding_scale!r}.")
        if not callable(trunk):
            raise TypeError(f"trunk must be callable (an NNX module), got {type(trunk).__name__}.")
        _check_trunk(trunk, embedding_features + z_features, trunk_features)
        super().__init__(
            target, trunk, trunk_features, param_dtype=param_dtype, rngs=rngs, **options
        )
        self.z_features = z_features
        draw = jax.random.normal(rngs.params(), (num_conditions, embedding_features))
        self.embeddings = nnx.Param((embedding_scale * draw).astype(param_dtype))

    def embed(self, condition: int | jax.Array, z: jax.Array | None = None) -> jax.Array:
        """The trunk's input for one condition: ``e_c``, or ``[e_c, z]`` with ``z_features``.

        Raises:
          TypeError: ``condition`` is not an integer.
          ValueError: ``condition`` is not a scalar, a concrete id is out of range, or ``z``
            is missing, unexpected or of the wrong shape.

        Example:
          >>> hnet.embed(3).shape
          (8,)
        """
        dtype = jnp.result_type(condition)
        if not jnp.issubdtype(dtype, jnp.integer) or isinstance(condition, bool):
            raise TypeError(
                f"condition must be an integer id in [0, {self.num_conditions}), got "
                f"{type(condition).__name__} of dtype {dtype}."
            )
        if jnp.shape(condition) != ():
            raise ValueError(
                f"condition must be one id (a scalar), got shape {jnp.shape(condition)}. For "
                f"several conditions, jax.vmap over them: jax.vmap(hnet, in_axes=(0, None))"
                f"(ids, x)."
            )
        n = self.num_conditions
        if not isinstance(condition, jax.core.Tracer) and not 0 <= int(condition) < n:
            raise ValueError(f"condition {int(condition)} is out of range: ids are 0..{n - 1}.")
        table = self.embeddings[...]
        # A traced id cannot be checked; index n (out of bounds) fills NaN instead of jnp's
        # silent clamp (a negative id would otherwise wrap around to the last condition).
        index = jnp.where((condition >= 0) & (condition < n), condition, n)
        e = jnp.take(table, index, axis=0, mode="fill", fill_value=jnp.nan)
        if self.z_features == 0:
            if z is not None:
                raise ValueError(
                    "this hypernetwork takes no z (z_features=0); build it with "
                    "z_features=... to condition on a free input as well."
                )
            return e
        if z is None:
            raise ValueError(
                f"z must have shape ({self.z_features},) (z_features), got none. Pass it by "
                f"keyword, hnet(condition, x, z=z) or hnet.generate(condition, z=z): a "
                f"positional argument after the condition goes to the target."
            )
        if jnp.shape(z) != (self.z_features,):
            raise ValueError(
                f"z must have shape ({self.z_features},) (z_features), got shape "
                f"{jnp.shape(z)}. For a batch of z, jax.vmap over it."
            )
        return jnp.concatenate([e, jnp.asarray(z, e.dtype)])

    def generate(self, condition: int | jax.Array, z: jax.Array | None = None) -> nnx.State:
        """The generated params for one condition: ``heads(trunk(embed(condition, z)))``.

        Example:
          >>> params = hnet.generate(2)
          >>> y = hyper.call(hnet.spec, params, x)    # == hnet(2, x)
        """
        h = self.trunk(self.embed(condition, z))
        return self._add_base(self._on_heads(self.heads, h, condition))

    def generate_vector(  # type: ignore[override]
        self, condition: int | jax.Array, z: jax.Array | None = None
    ) -> jax.Array:
        """One condition's generated params as one ``(spec.size,)`` vector, in the heads' own
        order (see :meth:`Hypernetwork.generate_vector`); ``hnet.params_of(v)`` is
        ``hnet.generate(condition, z)``, bitwise (with ``pretrained=``, where the generated
        tensors share the heads' dtype).

        Example:
          >>> params = hnet.params_of(hnet.generate_vector(2))   # == hnet.generate(2)
        """
        h = self.trunk(self.embed(condition, z))
        return self._add_base_vector(self._on_heads(self.heads.vector, h, condition))

    def generate_vectors(self, z: jax.Array | None = None) -> jax.Array:
        """Every condition's generated params at once: ``(num_conditions, spec.size)``.

        Row ``c`` is ``hnet.generate_vector(c, z)``; the whole is bitwise
        ``jax.vmap(hnet.generate_vector)(jnp.arange(num_conditions))``, without looking
        the embeddings up by id (a gather, whose gradient is a scatter): what a
        continual-learning step that regularizes every earlier task calls once.

        Args:
          z: with ``z_features``, one ``(z_features,)`` input for every condition, or one
            per condition, ``(num_conditions, z_features)``.

        Example:
          >>> now = hnet.generate_vectors()                        # (tasks, spec.size)
          >>> y = hyper.call(hnet.spec, hnet.params_of(now[task]), x)
          >>> reg = hyper.output_regularizer(lambda v: {"v": v}, now, stored, beta,
          ...                                where=jnp.arange(tasks) < task)
        """
        n = self.num_conditions
        inputs = self.embeddings[...]
        if self.z_features == 0:
            if z is not None:
                raise ValueError(
                    "this hypernetwork takes no z (z_features=0); build it with "
                    "z_features=... to condition on a free input as well."
                )
        else:
            shape = jnp.shape(z) if z is not None else None
            if shape not in ((self.z_features,), (n, self.z_features)):
                raise ValueError(
                    f"z must have shape ({self.z_features},) or ({n}, {self.z_features}) "
                    f"(z_features, one for all conditions or one each), got "
                    f"{'none' if z is None else f'shape {shape}'}."
                )
            z = jnp.broadcast_to(jnp.asarray(z, inputs.dtype), (n, self.z_features))
            inputs = jnp.concatenate([inputs, z], axis=-1)
        try:
            h = jax.vmap(self.trunk)(inputs)
        except flax.errors.TraceContextError as error:
            # Raised before the Variable changes: nothing is lost.
            state = nnx.to_flat_state(nnx.state(self.trunk, nnx.Not(nnx.Param)))
            held = ", ".join(f"trunk/{path_str(p)} ({type(v).__name__})" for p, v in state)
            raise ValueError(
                "generate_vectors runs the trunk on every condition at once (jax.vmap), and "
                "this trunk updates its own state as it runs (a BatchNorm's statistics or a "
                f"Dropout's random stream: {str(error).split(' (')[0]}; the trunk's state: "
                f"{held}). Call it on a view "
                "with those layers in evaluation mode (nnx.view(hnet, deterministic=True) "
                "for Dropout, use_running_average=True for BatchNorm), or generate one "
                "condition at a time in a Python loop: "
                "jnp.stack([hnet.generate_vector(c) for c in range(hnet.num_conditions)])."
            ) from error
        return self._add_base_vector(self._on_heads(self.heads.vector, h, EVERY_CONDITION))

    def _on_heads(self, method: Any, h: jax.Array, condition: Any) -> Any:
        """``method(h)``, with ``condition`` where the heads hold chunk embeddings per
        condition (one head per tensor, or shared chunk embeddings, take none)."""
        if getattr(self.heads, "num_conditions", None) is None:
            return method(h)
        return method(h, condition)

    def _chunk_tables(self) -> int | None:
        per_condition = self.chunk_embeddings == "per_condition"
        return self.num_conditions if per_condition else None

    def __call__(
        self, condition: int | jax.Array, *args: Any, z: jax.Array | None = None, **kwargs: Any
    ) -> Any:
        """Runs the target on ``*args, **kwargs`` with the params generated for ``condition``.

        Example:
          >>> y = hnet(2, x)
          >>> ys = jax.vmap(hnet, in_axes=(0, None))(jnp.arange(5), x)
        """
        return self._run_target(self.generate(condition, z), args, kwargs)
