"""Read-only configuration: what a front-end's compiled program was built from."""

from __future__ import annotations

from typing import Any


class Config:
    """A read-only attribute reading ``instance._config[name]``.

    ``Trainer`` and ``Population`` build their compiled program once, from ``loss_fn``,
    ``has_aux``, ... ; assigning one afterwards would change ``evaluate`` but not ``fit``,
    so it raises instead (build a new Trainer to change them).
    """

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        return self if instance is None else instance._config[self.name]

    def __set__(self, instance: Any, value: Any) -> None:
        raise AttributeError(
            f"{self.name} is read-only: the compiled program was built from it; build a new "
            f"{type(instance).__name__} to use another."
        )
