"""conftest's lanes: a test marked ``slow_on_accelerator`` moves to the slow lane off the CPU.

The reference is pytest's own marker reading (``get_closest_marker``) on real collected
items, and the markers counted in the test files' source.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from conftest import lane_for_backend


class _Item:
    """What ``lane_for_backend`` reads of a pytest item: its markers, by name."""

    def __init__(self, nodeid: str, *marks: pytest.MarkDecorator) -> None:
        self.nodeid, self.marks = nodeid, [m.mark for m in marks]

    def get_closest_marker(self, name: str):
        return next((m for m in self.marks if m.name == name), None)

    def add_marker(self, mark: pytest.MarkDecorator) -> None:
        self.marks.append(mark.mark)


def test_marked_tests_move_to_the_slow_lane_off_the_cpu_only():
    def items():
        return [
            _Item("a", pytest.mark.slow_on_accelerator("compiles")),
            _Item("b"),
            _Item("c", pytest.mark.slow),
        ]

    on_cpu = items()
    assert lane_for_backend(on_cpu, "cpu") == 0
    assert [i.get_closest_marker("slow") is not None for i in on_cpu] == [False, False, True]
    on_tpu = items()
    assert lane_for_backend(on_tpu, "tpu") == 1
    assert [i.get_closest_marker("slow") is not None for i in on_tpu] == [True, False, True]


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_a_mark_without_a_reason_is_refused_on_every_backend(backend):
    for mark in (pytest.mark.slow_on_accelerator, pytest.mark.slow_on_accelerator("  ")):
        with pytest.raises(pytest.UsageError, match="x: slow_on_accelerator needs a reason"):
            lane_for_backend([_Item("x", mark)], backend)


def test_only_fast_lane_test_functions_are_marked():
    """A mark on a helper or on a test already in the slow lane would do nothing: refused."""
    marked = []
    for path in sorted(pathlib.Path(__file__).parent.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                decorators = [ast.unparse(d) for d in node.decorator_list]
                if any("slow_on_accelerator" in d for d in decorators):
                    assert node.name.startswith("test_"), (path.name, node.name)
                    assert "pytest.mark.slow" not in decorators, (path.name, node.name)
                    marked.append(node.name)
    assert len(marked) == len(set(marked)) >= 15
