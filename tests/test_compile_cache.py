"""The opt-in persistent compilation cache: a second process compiles nothing it trained."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np, optax
    from flax import nnx
    events = {"hits": 0, "misses": 0}
    def on_event(name, **kwargs):
        if name == "/jax/compilation_cache/cache_hits":
            events["hits"] += 1
        if name == "/jax/compilation_cache/cache_misses":
            events["misses"] += 1
    jax.monitoring.register_event_listener(on_event)
    from nnxscan.shell import Trainer, enable_compilation_cache
    enable_compilation_cache(sys.argv[1])
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    data = {"x": x, "y": (x[:, 0] > 0).astype(np.int32)}
    loss = lambda m, b: optax.softmax_cross_entropy_with_integer_labels(m(b["x"]), b["y"]).mean()
    Trainer(model, optax.adam(1e-2), loss).fit(data, epochs=2, batch_size=16, progress=False)
    print(json.dumps(events))
    """
)


def _run(cache) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(cache)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a second process
def test_a_second_process_reads_every_program_from_the_cache(tmp_path):
    first = _run(tmp_path / "cache")
    second = _run(tmp_path / "cache")
    assert first["misses"] > 0 and first["hits"] == 0
    assert second["misses"] == 0 and second["hits"] == first["misses"]
    assert any((tmp_path / "cache").iterdir())


@pytest.mark.slow  # a fresh Python process (~1.5 s)
def test_importing_nnxscan_does_not_turn_the_cache_on():
    code = "import jax, nnxscan.shell; print(jax.config.jax_compilation_cache_dir)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "None", out.stdout + out.stderr
