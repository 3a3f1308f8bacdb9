"""ARCHITECTURE.md's layering rules, enforced on the source."""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
THIRD_PARTY_IN_PURE = {"jax", "flax", "optax", "numpy"}
# Standard-library modules that would bring I/O, clocks or global state into the core.
FORBIDDEN_IN_PURE = {
    "time", "datetime", "logging", "io", "os", "pathlib", "threading", "multiprocessing",
    "random", "socket", "subprocess", "shutil", "tempfile", "warnings", "sys", "builtins",
}  # fmt: skip
FORBIDDEN_CALLS_IN_PURE = {"print", "open", "input", "breakpoint"}


def _sources(layer: str) -> list[pathlib.Path]:
    files = sorted((ROOT / layer).rglob("*.py"))
    assert files, f"no sources under {layer}/"
    return files


def _imports(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.ImportFrom):
            pytest.fail(f"{path}: relative import; import across layers by full name")
    return names


@pytest.mark.parametrize("path", _sources("pure"), ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_imports_only_jax_flax_optax_numpy_and_safe_stdlib(path):
    for name in _imports(path):
        top = name.split(".")[0]
        if top == "nnxscan":
            assert name.startswith("nnxscan.pure"), f"{path} imports {name}"
            continue
        assert top not in FORBIDDEN_IN_PURE, f"{path} imports {name} (I/O, clock or state)"
        assert (
            top in THIRD_PARTY_IN_PURE or top in sys.stdlib_module_names or top == "__future__"
        ), f"{path} imports third-party {name}"


@pytest.mark.parametrize("path", _sources("pure"), ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_never_prints_or_opens_files(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in FORBIDDEN_CALLS_IN_PURE, f"{path} calls {node.func.id}()"
        if isinstance(node, ast.Global):
            pytest.fail(f"{path} uses global state: {ast.unparse(node)}")


@pytest.mark.parametrize("path", _sources("adapters"), ids=lambda p: str(p.relative_to(ROOT)))
def test_adapters_never_import_the_shell(path):
    for name in _imports(path):
        assert not name.startswith("nnxscan.shell"), f"{path} imports {name}"


@pytest.mark.parametrize(
    "path", _sources("pure") + _sources("adapters"), ids=lambda p: str(p.relative_to(ROOT))
)
def test_only_the_shell_calls_nnx_update(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flax"):
            names = {alias.name for alias in node.names}
            assert "update" not in names, f"{path} imports update from {node.module}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            assert node.func.attr != "update" or ast.unparse(node.func.value) != "nnx", (
                f"{path} calls nnx.update: only the shell mutates NNX objects"
            )


def test_no_top_level_pure_or_shell_package_is_installed():
    import nnxscan.pure

    assert pathlib.Path(nnxscan.pure.__file__).parent == ROOT / "pure"
    for name in ("pure", "shell", "adapters"):
        spec = importlib.util.find_spec(name)
        # From the repository root, the folders themselves are importable; anywhere else
        # (site-packages) nothing by these names may exist.
        origin = pathlib.Path(spec.origin or spec.submodule_search_locations[0]) if spec else None
        assert spec is None or origin.is_relative_to(ROOT), f"top-level {name!r} installed"


def test_import_has_no_side_effects():
    code = textwrap.dedent(
        """
        import logging, warnings, jax
        compiles = []
        jax.monitoring.register_event_duration_secs_listener(
            lambda e, *a, **k: compiles.append(e) if "backend_compile" in e else None)
        before = (dict(jax.config.values), list(warnings.filters),
                  list(logging.getLogger().handlers), logging.getLogger().level)
        import nnxscan.pure, nnxscan.pure.hyper, nnxscan.shell, nnxscan.adapters
        import nnxscan.adapters.nnx_optimizer, nnxscan.adapters.data, nnxscan.adapters.checkpoint
        import nnxscan.adapters.writers
        after = (dict(jax.config.values), list(warnings.filters),
                 list(logging.getLogger().handlers), logging.getLogger().level)
        assert before == after, "importing nnxscan changed global configuration"
        assert not compiles, compiles
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
