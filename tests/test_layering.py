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


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_core_imports(path: pathlib.Path) -> list[str]:
    """Every import in ``path`` of a private module of the core (a part of its dotted path
    under ``nnxscan.pure`` starts with ``_``): ``import nnxscan.pure._x``, ``from
    nnxscan.pure._x import y``, ``from nnxscan.pure import _x``, and the same through
    ``importlib.import_module("nnxscan.pure._x")``, wherever it stands in the file."""

    def private(dotted: str) -> bool:
        parts = dotted.split(".")
        return parts[:2] == ["nnxscan", "pure"] and any(_is_private(p) for p in parts[2:])

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [a.name for a in node.names]
            if private(node.module) or any(private(f"{node.module}.{n}") for n in names):
                found.append(f"from {node.module} import {', '.join(names)}")
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in (
            "importlib.import_module",
            "import_module",
            "__import__",
        ):
            first = node.args[0] if node.args else None
            literal = isinstance(first, ast.Constant) and isinstance(first.value, str)
            if literal and private(first.value):
                found.append(ast.unparse(node))
    return found


@pytest.mark.parametrize(
    "path", _sources("shell") + _sources("adapters"), ids=lambda p: str(p.relative_to(ROOT))
)
def test_shell_and_adapters_use_only_the_public_core(path):
    """The shell and the adapters are written on what ``nnxscan.pure`` publishes, so a user
    could write them too: a helper they need is made public in the core (or moved to the
    shell), never imported from a ``_`` module."""
    found = _private_core_imports(path)
    assert not found, f"{path.relative_to(ROOT)} imports private modules of the core: {found}"


def test_the_private_import_detector_sees_each_form(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import nnxscan.pure._loops\n"
        "from nnxscan.pure._checks import check_count\n"
        "from nnxscan.pure import _members, scan_steps\n"
        "from nnxscan.pure.hyper._spec import x\n"
        "def f():\n"
        "    import importlib\n"
        "    return importlib.import_module('nnxscan.pure._node')\n"
    )
    assert len(_private_core_imports(probe)) == 5
    clean = tmp_path / "clean.py"
    clean.write_text(
        "import nnxscan.pure\n"
        "from nnxscan.pure import scan_steps, checks\n"
        "from nnxscan.pure.checks import check_count\n"
        "from nnxscan.shell import _owner\n"
        "from nnxscan.pure import __version__\n"
    )
    assert _private_core_imports(clean) == []


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

    # An editable install maps nnxscan.pure onto the checkout's pure/; a wheel (how the
    # accelerator machine runs the suite) installs it as nnxscan/pure in site-packages.
    where = pathlib.Path(nnxscan.pure.__file__).parent
    assert where in (ROOT / "pure", pathlib.Path(nnxscan.__file__).parent / "pure")
    for name in ("pure", "shell", "adapters"):
        spec = importlib.util.find_spec(name)
        # From the repository root, the folders themselves are importable; anywhere else
        # (site-packages) nothing by these names may exist.
        origin = pathlib.Path(spec.origin or spec.submodule_search_locations[0]) if spec else None
        assert spec is None or origin.is_relative_to(ROOT), f"top-level {name!r} installed"


@pytest.mark.slow  # a fresh Python process (~1.5 s)
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
        # nnxscan.shell loads its public names on first use: load every one.
        [getattr(nnxscan.shell, name) for name in nnxscan.shell.__all__]
        after = (dict(jax.config.values), list(warnings.filters),
                 list(logging.getLogger().handlers), logging.getLogger().level)
        assert before == after, "importing nnxscan changed global configuration"
        assert not compiles, compiles
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# -- the package's shape: no import cycles, one owner, curated public names ---------------------

PACKAGES = {"nnxscan.pure": "pure", "nnxscan.shell": "shell", "nnxscan.adapters": "adapters"}


def _module_name(path: pathlib.Path) -> str:
    for package, folder in PACKAGES.items():
        base = ROOT / folder
        if path.is_relative_to(base):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([package, *parts])
    raise AssertionError(path)


def _type_checking_imports(tree: ast.AST) -> set[int]:
    """The ids of the import nodes under ``if TYPE_CHECKING:``: they never run."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def _import_graph(running: bool = False) -> dict[str, set[str]]:
    """Every import between nnxscan modules, wherever it stands (module level, inside a
    function, under ``if TYPE_CHECKING``): a cycle through any of them is a design knot.
    With ``running``, only the imports that run (not those under ``if TYPE_CHECKING``)."""
    files = [p for folder in PACKAGES.values() for p in sorted((ROOT / folder).rglob("*.py"))]
    modules = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skipped = _type_checking_imports(tree) if running else set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                # ``from pkg import mod`` depends on the submodule when there is one, else
                # on ``pkg`` itself (a name its __init__ re-exports). Parent packages that
                # Python initializes on the way are not edges: every submodule has them.
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.append(sub if sub in modules else node.module)
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    graph = _import_graph()
    assert len(graph) > 20 and graph["nnxscan.shell.trainer"], "the graph builder broke"
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


# The shell's layers, top to bottom (docs/architecture.md, "Where things live"): the front
# doors users call, the one engine they share (shell/_engine/), its edges to the disk, the
# terminal and the clock (shell/_edges/). An import runs down, never back up. The modules
# below import no other shell module and serve every layer: values a user holds (History),
# the read-only Config, the checks that a model is an NNX module.
SHELL_LAYERS = {"front doors": 0, "engine": 1, "edges": 2}
SHELL_SHARED = {"nnxscan.shell.history", "nnxscan.shell._config", "nnxscan.shell._module_check"}


def _shell_layer(module: str) -> str | None:
    if module.startswith("nnxscan.shell._edges"):
        return "edges"
    if module.startswith("nnxscan.shell._engine"):
        return "engine"
    return "front doors" if module.startswith("nnxscan.shell") else None


def _imports_back_up(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module in sorted(graph):
        here = _shell_layer(module)
        for target in sorted(graph[module]):
            there = _shell_layer(target)
            if not here or not there or target in SHELL_SHARED:
                continue
            if SHELL_LAYERS[there] < SHELL_LAYERS[here]:
                found.append(f"{module} ({here}) imports {target} ({there})")
    return found


def test_the_shell_imports_run_one_way():
    graph = _import_graph(running=True)
    assert graph["nnxscan.shell._engine.engine"] >= {"nnxscan.shell._edges.checkpointing"}
    for shared in SHELL_SHARED:
        assert not {t for t in graph[shared] if _shell_layer(t)}, f"{shared} imports the shell"
    assert _imports_back_up(graph) == []
    # The edges may name the engine's types for annotations (never run), nothing else.
    full = _import_graph()
    assert "nnxscan.shell._engine.layout" in full["nnxscan.shell._edges.logs"]
    assert "nnxscan.shell._engine.layout" not in graph["nnxscan.shell._edges.logs"]


def test_the_back_up_finder_sees_each_direction():
    graph = {
        "nnxscan.shell._edges.logs": {"nnxscan.shell._engine.layout", "nnxscan.shell.history"},
        "nnxscan.shell._engine.fit": {"nnxscan.shell._edges.warn", "nnxscan.shell.trainer"},
        "nnxscan.shell.trainer": {"nnxscan.shell._engine.fit", "nnxscan.pure.step"},
        "nnxscan.shell._engine.layout": {"nnxscan.shell._population_checks"},
    }
    assert _imports_back_up(graph) == [
        "nnxscan.shell._edges.logs (edges) imports nnxscan.shell._engine.layout (engine)",
        "nnxscan.shell._engine.fit (engine) imports nnxscan.shell.trainer (front doors)",
        "nnxscan.shell._engine.layout (engine) imports nnxscan.shell._population_checks "
        "(front doors)",
    ]


# Modules of the core may change their OWN variables inside their forward pass, as any NNX
# layer does (BatchNorm's running mean): Hypernetwork writes back the batch statistics and
# RNG counts its target's forward moved. That is the module's own state under its own call,
# not a mutation of a user object from outside; nothing else in pure/ may assign in place.
# canonical_conv_dimensions's memo of rewritten jaxprs is a trace-time cache (dict entries, no
# pytree or Variable), like jax.jit's own.
IN_PLACE_ALLOWED = {
    ("pure/hyper/hypernetwork.py", "_write_back_changes"),
    ("pure/conv_dimensions.py", "put"),
    ("pure/conv_dimensions.py", "keep_nested"),
}


def _in_place_writes(path: pathlib.Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of every ``x[...] = v``, ``x.value = v``, ``x.set_value()``."""
    found = []

    def walk(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = function
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = child.name
            if isinstance(child, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                for target in targets:
                    subscript = isinstance(target, ast.Subscript)
                    value_attr = isinstance(target, ast.Attribute) and target.attr == "value"
                    if subscript or value_attr:
                        found.append((function, child.lineno))
            call = isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
            if call and child.func.attr == "set_value":
                found.append((function, child.lineno))
            walk(child, name)

    walk(ast.parse(path.read_text()), "<module>")
    return found


@pytest.mark.parametrize("path", _sources("pure"), ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_assigns_no_variable_in_place(path):
    rel = str(path.relative_to(ROOT))
    for function, line in _in_place_writes(path):
        assert (rel, function) in IN_PLACE_ALLOWED, (
            f"{rel}:{line} in {function}() assigns in place; the core returns new pytrees"
        )


def test_the_in_place_detector_sees_variable_writes(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(v, x):\n    v[...] = x\n    v.value = x\n    v.set_value(x)\n")
    assert [line for _, line in _in_place_writes(probe)] == [2, 3, 4]


def test_only_the_owner_calls_nnx_update_in_the_shell():
    callers = set()
    for path in _sources("shell"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "nnx.update":
                callers.add(str(path.relative_to(ROOT)))
    assert callers == {"shell/_engine/owner.py"}


PUBLIC = {
    "nnxscan.pure": {
        "Step", "make_train_step", "init_opt_state", "scan_steps", "make_epoch", "epoch_order",
        "make_eval_step", "make_evaluate", "make_evaluate_metrics", "split_wrt",
        "all_finite", "tree_select", "halt_after_nonfinite", "canonical_conv_dimensions",
        "stack_states", "unstack_states", "with_hyperparams", "vmap_members", "MembersState",
        "HaltState", "scan_indexed_steps", "member_state", "select_members",
        "hyperparam_names", "hyperparam_value", "nnx_train_step", "step_outputs",
        "skip_nonfinite", "build_compiled", "compile_once", "paused_gc",
    },
    "nnxscan.shell": {
        "Trainer", "scan_train", "History", "Plan", "EarlyStopping", "LambdaCallback",
        "enable_compilation_cache", "Preempted", "NonFiniteLossWarning",
        "Population", "train_tasks", "FitArguments", "find_learning_rate",
        "LRFinderResult", "load_model",
    },
}  # fmt: skip


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_each_package_exports_its_contract_and_nothing_else(package):
    import importlib
    import inspect

    module = importlib.import_module(package)
    assert set(module.__all__) == PUBLIC[package]
    for name in module.__all__:
        obj = getattr(module, name)
        doc = inspect.getdoc(obj) or ""
        assert "Example" in doc or ">>>" in doc, f"{package}.{name} has no example"


def test_private_modules_publish_no_all():
    for folder in PACKAGES.values():
        for path in (ROOT / folder).rglob("_*.py"):
            if path.name == "__init__.py":
                continue
            tree = ast.parse(path.read_text())
            names = [
                t.id
                for node in tree.body
                if isinstance(node, ast.Assign)
                for t in node.targets
                if isinstance(t, ast.Name)
            ]
            assert "__all__" not in names, f"{path.relative_to(ROOT)} is private: no __all__"


def _public_modules() -> list[str]:
    """Every module of the three packages whose dotted path has no ``_`` part (demos are
    example programs, not library API)."""
    import pkgutil

    names = []
    for package in ("nnxscan.pure", "nnxscan.shell", "nnxscan.adapters"):
        module = importlib.import_module(package)
        for info in pkgutil.walk_packages(module.__path__, package + "."):
            parts = info.name.split(".")[2:]
            if not any(p.startswith("_") for p in parts) and parts[:1] != ["demos"]:
                names.append(info.name)
    return names


@pytest.mark.parametrize("name", _public_modules())
def test_public_modules_hold_no_unlisted_internals(name):
    """A public module defines only what its ``__all__`` lists; the core's public modules
    also re-expose no internal (``from nnxscan.pure._x import y`` would make
    ``nnxscan.pure.<module>.y`` importable): internals live in ``_`` modules."""
    import inspect

    module = importlib.import_module(name)
    listed = set(getattr(module, "__all__", ()))
    for attr, obj in vars(module).items():
        if attr.startswith("_") or attr in listed:
            continue
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        origin = getattr(obj, "__module__", "") or ""
        assert origin != name, f"{name}.{attr} is defined there but not in its __all__"
        if name.startswith("nnxscan.pure"):
            private = any(p.startswith("_") for p in origin.split(".")[2:])
            assert not private, f"{name}.{attr} re-exposes the internal {origin}.{attr}"


# -- one model or members: one seam ---------------------------------------------------------

#: Where the shell tells one model from members (docs/architecture.md, "The layout seam").
LAYOUT_SEAM = {"shell/_engine/layout.py"}
#: A layout compared with None: the names the engine used for it before the seam.
_LAYOUT_OR_NONE = {"members", "num_members", "stacked", "member_layout"}
#: A layout tested for truth.
_LAYOUT_FLAGS = {"stacked", "member_batches", "one_model", "data_per_member", "shared_batch"}
#: Types whose isinstance test asks which layout it is.
_LAYOUT_TYPES = {"OneModel", "Members", "ModelOwner", "StackedOwner", "MembersState"}
#: Sites the patterns match that ask no such question (a reason each).
_NOT_LAYOUT = {
    # "every member, or these": an argument default, not one model or members.
    ("shell/population.py", "members is None"),
}


def _asks_the_layout(test: ast.expr) -> bool:
    """Whether a condition asks "one model or members": a layout's name compared with None
    or tested for truth, ``getattr(x, "num_members", ...)``, ``isinstance(seeds, int)``,
    an ``isinstance`` against an owner or layout type, or ``x.active is None``."""

    def name(node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return node.id
        return node.attr if isinstance(node, ast.Attribute) else None

    def tested(node: ast.expr) -> list[ast.expr]:  # the operands whose truth decides
        if isinstance(node, ast.BoolOp):
            return [x for value in node.values for x in tested(value)]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return tested(node.operand)
        return [node]

    for node in tested(test):
        if name(node) in _LAYOUT_FLAGS:
            return True
    for node in ast.walk(test):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            with_none = any(isinstance(x, ast.Constant) and x.value is None for x in operands)
            names = {name(x) for x in operands}
            if with_none and (
                names & _LAYOUT_OR_NONE
                or "active" in {x.attr for x in operands if isinstance(x, ast.Attribute)}
            ):
                return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = node.args
            if node.func.id == "getattr" and any(
                isinstance(a, ast.Constant) and a.value == "num_members" for a in args
            ):
                return True
            if node.func.id == "isinstance" and len(args) == 2:
                kinds = {name(x) for x in ast.walk(args[1])}
                seeds = (name(args[0]) or "").endswith("seeds") and "int" in kinds
                if seeds or kinds & _LAYOUT_TYPES:
                    return True
    return False


def _layout_branches(path: pathlib.Path, relative: str) -> list[str]:
    """Every branch in ``path`` whose condition asks :func:`_asks_the_layout`."""
    tree = ast.parse(path.read_text())
    tests = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If | ast.IfExp | ast.While):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests += node.ifs
    return [
        f"{relative}:{test.lineno}: {ast.unparse(test)}"
        for test in tests
        if _asks_the_layout(test) and (relative, ast.unparse(test)) not in _NOT_LAYOUT
    ]


def test_one_model_or_members_is_asked_in_the_seam_alone():
    """What differs between one model and members lives in the layout seam
    (``shell/_engine/layout.py``: ``OneModel`` and ``Members``); the rest of the shell and
    the adapters consume it without a branch. At most two branches remain, at the far
    edges that only read what the object training runs declares (``num_members``)."""
    sites = []
    for path in _sources("shell") + _sources("adapters"):
        relative = str(path.relative_to(ROOT))
        if relative.startswith("shell/demos/") or relative in LAYOUT_SEAM:
            continue
        sites += _layout_branches(path, relative)
    assert len(sites) <= 2, "branches on one model or members outside the seam:\n" + "\n".join(
        sites
    )


def test_the_layout_branch_counter_sees_each_form(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        textwrap.dedent(
            """\
            def f(self, members, stacked, member_batches, seeds, trainer, owner):
                if members is None: pass
                x = 1 if self.num_members is not None else 2
                if stacked: pass
                if not member_batches and True: pass
                if isinstance(seeds, int): pass
                if getattr(trainer, "num_members", None): pass
                if owner.active is None: pass
                y = [i for i in seeds if isinstance(owner, StackedOwner)]
                while isinstance(self.seeds, int): pass
            """
        )
    )
    assert len(_layout_branches(probe, "probe.py")) == 9
    clean = tmp_path / "clean.py"
    clean.write_text(
        textwrap.dedent(
            """\
            def f(layout, member, values, logs):
                if member is not None and member in values: pass
                value = layout.value(values) if values is not None else None
                if values.shape != (layout.num_members,): pass
                active = logs.get("active")
                if active is not None: pass
            """
        )
    )
    assert _layout_branches(clean, "clean.py") == []
