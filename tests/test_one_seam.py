"""No code asks "one model or members" except the members wrapper and one reader.

What differs between training one model and a population's members is declared in one
seam: the members wrapper (``pure/members.py``'s ``vmap_members``, with how an epoch
orders members, and the shell's layout, ``shell/_engine/layout.py``), and, for writers and
callbacks outside the shell's engine, ONE reader of ``num_members``
(``adapters/_log_values.logs_of``; ``history_members`` beside it for a History that
declares none). This test reads the
package's source with ``ast`` and counts both ways code could ask anyway:

- by name: a branch that tests ``x.num_members``, a variable ``num_members`` against None,
  ``Members``/``OneModel``/``ONE_MODEL``/``MembersState``, or any ``getattr(x,
  "num_members", ...)`` probe;
- by shape: a branch (``if``, a conditional expression, ``while``, ``assert``, a
  comprehension's ``if``, ``match``'s subject, or a predicate's ``return`` of a comparison,
  whose caller branches on it) whose test reads ``.ndim``, ``.shape``, ``np.ndim(...)``,
  ``np.shape(...)``, ``len(x.shape)``, ``isinstance(x, np.ndarray)`` or calls
  ``is_scalar(...)`` (the name the package once gave "a scalar, not an array": a shape
  test, whatever it is named).

Shape tests that validate an argument or read a data structure (not "which kind of run")
are listed in ``OTHER_SHAPE_TESTS`` with their reason. Nothing else asks: ``make_epoch`` is
told its number of members (``num_members=``), a ``History`` says how many members it
logs (``History.num_members``), and an epoch's logs are read as the run's layout (or
``logs_of``) says: their leading members axis, if any, is the layout's, and only one
model's layout, which has none, reads a value's rank (the log's own: a metric per class).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("pure", "shell", "adapters")

#: The members wrapper and the one reader: where asking is the point.
SEAM = {
    ("pure/members.py", None),
    ("shell/_engine/layout.py", None),
    ("adapters/_log_values.py", "logs_of"),
    # A History that declares no num_members (built by hand, or pickled before it had
    # one): its losses' shape is all there is to read.
    ("adapters/_log_values.py", "history_members"),
    # logs_of's members side: whether a log holds one value per member, (N,).
    ("adapters/_log_values.py", "per_member"),
}

#: Shape tests about something else than one model or members, by (file, function).
OTHER_SHAPE_TESTS = {
    ("adapters/_checkpoint_manifest.py", "fits"): "a manifest entry against a template leaf",
    ("adapters/_checkpoint_packing.py", None): "a checkpoint leaf's type (numpy or jax)",
    ("adapters/_checkpoint_read.py", None): "a template leaf's type",
    ("adapters/_checkpoint_shards.py", "damaged"): "a restored array: numpy or a jax.Array",
    ("adapters/_log_values.py", "to_exact_json"): "a value's type",
    ("adapters/data.py", None): "a data record's leaves",
    ("adapters/nnx_optimizer.py", "_shape_dtype"): "a leaf's type",
    ("adapters/nnx_optimizer.py", "optax_state_from_optimizer"): "a leaf against its template",
    ("pure/batching.py", "_gathers_as_bytes"): "a data leaf's row bytes",
    ("pure/batching.py", "full_then_tail"): "a data set's rows against its full batches",
    ("pure/build.py", "_hashed"): "a traced draw's key (a scalar key)",
    ("pure/conv_dimensions.py", "_conv_in_canonical_order"): "a convolution's operands",
    ("pure/hyper/chunked.py", None): "a condition (a scalar index) and the trunk's features",
    ("pure/hyper/conditional.py", "embed"): "a condition and an embedding's width",
    ("pure/hyper/heads.py", "_pieces"): "the trunk's features",
    ("pure/hyper/structured.py", None): "a target leaf's shape",
    ("pure/nnx_step.py", "step_outputs"): "a step's loss must be a scalar",
    ("pure/_host_init.py", "_placement"): "numpy leaves",
    ("pure/checks.py", "check_leading_size"): "a scalar leaf has no examples axis",
    ("pure/hyper/continual.py", None): "a hypernetwork's task embeddings",
    ("pure/hyper/spec.py", None): "a hypernetwork's target shapes",
    ("pure/hyper/variance.py", None): "kernels and biases by rank",
    ("pure/hyper/vector.py", None): "a generated leaf's trailing shape",
    ("pure/population.py", "with_hyperparams"): "a hyperparameter must be a scalar",
    ("pure/scan.py", None): "batch numbers (1-D) are sliced, index arrays gathered",
    ("pure/train_step.py", "cut"): "a scalar loss is not cut into micro-batches",
    ("pure/train_step.py", "_check_same_structure"): "a step returns its variables as given",
    ("shell/_engine/owner.py", "_swappable"): "a Variable's value type",
    ("shell/_engine/epochs.py", "_yield_calls"): "a call's steps against the index's",
    ("shell/_engine/member_build.py", "_stacked_on_host"): "every member's leaves alike",
    ("shell/_engine/members.py", "load"): "a loaded state against the one held",
    ("shell/_engine/streaming.py", "is_stream"): "a data set's type",
    ("shell/_population_checks.py", None): "argument checks (seeds, hyperparams)",
    ("shell/population.py", "fit"): "a population's per-member logs (it knows it is one)",
    ("shell/_scan_train.py", "_check_steps_axis"): "stacked batches need a steps axis",
    ("shell/_scan_train.py", "_given"): "an opt_state leaf against its template",
    # Each watch checks its monitored value once logs_of picked it: () or (N,).
    ("shell/callbacks.py", "values"): "EarlyStopping's monitored value, as its watch needs",
}

_KINDS = {"Members", "OneModel", "ONE_MODEL", "MembersState"}
#: Helpers that test a value's shape under a name: a call counts as ``np.ndim`` would
#: (``is_scalar``, gone from the package, stays counted should it come back).
SHAPE_HELPERS = {"is_scalar"}


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _by_name(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and node.attr == "num_members":
        return True
    # A variable named num_members asks when it is tested for None (it is a count
    # otherwise: a shape to check against, a size).
    if isinstance(node, ast.Compare) and any(map(_is_none, node.comparators)):
        return isinstance(node.left, ast.Name) and node.left.id == "num_members"
    if isinstance(node, ast.Constant) and node.value == "num_members":
        return True
    return isinstance(node, ast.Name) and node.id in _KINDS


def _by_shape(node: ast.AST) -> bool:
    if isinstance(node, ast.Attribute) and node.attr in ("ndim", "shape"):
        return True
    if not isinstance(node, ast.Call):
        return False
    func, args = node.func, node.args
    if isinstance(func, ast.Attribute) and func.attr in ("ndim", "shape"):
        return True  # np.ndim(x), np.shape(x), jnp.shape(x)
    # The named value test: still a shape read, so no members question hides behind it.
    if ast.unparse(func).rsplit(".", 1)[-1] in SHAPE_HELPERS:
        return True
    if isinstance(func, ast.Name) and func.id == "len" and args:
        return isinstance(args[0], ast.Attribute) and args[0].attr == "shape"
    if isinstance(func, ast.Name) and func.id == "isinstance" and len(args) == 2:
        return "ndarray" in ast.unparse(args[1])
    return False


def _tests(tree: ast.AST):
    """``(function, test)`` for every branch's test, with the function it is in."""

    def visit(node: ast.AST, function: str | None):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
        if isinstance(node, ast.If | ast.IfExp | ast.While | ast.Assert):
            yield function, node.test
        elif isinstance(node, ast.Match):
            yield function, node.subject
        elif isinstance(node, ast.Return) and isinstance(node.value, ast.Compare | ast.BoolOp):
            yield function, node.value  # a predicate: the branch is its caller's
        elif isinstance(node, ast.comprehension):
            for test in node.ifs:
                yield function, test
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "getattr"
            and len(node.args) >= 2
            and _by_name(node.args[1])
        ):
            yield function, node
        for child in ast.iter_child_nodes(node):
            yield from visit(child, function)

    yield from visit(tree, None)


def _decisions() -> dict[tuple[str, str | None], list[str]]:
    found: dict[tuple[str, str | None], list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for function, test in _tests(ast.parse(path.read_text())):
                nodes = list(ast.walk(test))
                kind = "name" if any(map(_by_name, nodes)) else None
                kind = kind or ("shape" if any(map(_by_shape, nodes)) else None)
                if kind:
                    line = f"{rel}:{test.lineno} ({kind}) {ast.unparse(test)[:80]}"
                    found.setdefault((rel, function), []).append(line)
    return found


def _allowed(key: tuple[str, str | None], table) -> bool:
    return key in table or (key[0], None) in table


def test_only_the_seam_asks_one_model_or_members():
    found = _decisions()
    asking = {
        key: lines
        for key, lines in found.items()
        if not _allowed(key, SEAM)
        and not (_allowed(key, OTHER_SHAPE_TESTS) and all("(shape)" in x for x in lines))
    }  # fmt: skip
    assert not asking, "asked outside the seam:\n" + "\n".join(
        line for lines in asking.values() for line in lines
    )


def test_every_other_shape_test_listed_is_still_there():
    found = _decisions()
    unused = sorted(key for key in OTHER_SHAPE_TESTS if not any(
        k[0] == key[0] and (key[1] is None or k[1] == key[1]) for k in found))  # fmt: skip
    assert not unused, f"no shape test left there: drop {unused} from OTHER_SHAPE_TESTS"


def test_the_counter_sees_both_kinds():
    """The counter itself: it finds a branch by name and one by shape (a reference it
    must flag), and nothing in a plain computation."""
    source = (
        "def f(t, x, num_members):\n"
        "    if getattr(t, 'num_members', None) is None: pass\n"
        "    if num_members is not None: pass\n"
        "    y = 1 if x.ndim == 2 else 0\n"
        "    if not is_scalar(x): pass\n"
        "    z = [v for v in x if _log_values.is_scalar(v)]\n"
        "    assert x.shape == (num_members,)\n"
        "    if np.shape(x) == (3,): pass\n"
        "    match x.shape:\n"
        "        case (): pass\n"
        "    if t.epochs > 1: pass\n"
        "    return len(x.shape) + x.ndim + is_scalar(x)\n"
        "def is_members(x):\n"
        "    return x.shape != ()\n"
    )
    kinds = []
    for _, test in _tests(ast.parse(source)):
        nodes = list(ast.walk(test))
        name, shape = any(map(_by_name, nodes)), any(map(_by_shape, nodes))
        kinds.append("name" if name else "shape" if shape else None)
    assert kinds == ["name", "name", "name", *["shape"] * 6, None, "shape"]


def test_a_wrappers_state_is_built_by_its_wrapper_alone():
    """``HaltState`` is built by ``halt_after_nonfinite`` (pure/nonfinite.py), ``MembersState``
    by ``vmap_members`` (pure/members.py): as optax's wrappers, nothing else constructs
    them (the shell builds a call's carry with the wrapped step's ``init``)."""
    owners = {"HaltState": "pure/nonfinite.py", "MembersState": "pure/members.py"}
    built = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    name = ast.unparse(node.func).rsplit(".", 1)[-1]
                    if name in owners and owners[name] != rel:
                        built.append(f"{rel}:{node.lineno} {ast.unparse(node)[:80]}")
    assert not built, "a wrapper's state built outside its wrapper:\n" + "\n".join(built)
