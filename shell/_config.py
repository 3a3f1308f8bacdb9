"""A front door's read-only attributes, declared as one line each: what its compiled
program was built from (:class:`Config`), and what its owner holds (:class:`Owned`)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


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


class Owned(Generic[T]):
    """A read-only attribute reading ``instance._owner.<name>``: what the owner of the
    user's objects holds (the model, the counters), shown by the front door as it is.

    The owner is the one place that reads and writes them (docs/architecture.md), so a
    front door declares which of its attributes it shows, one line each, and never keeps
    a copy. ``Owned[nnx.Module]("...")`` gives the attribute its type; ``change`` says what
    changes it instead of an assignment.
    """

    def __init__(
        self, doc: str, *, change: str = "load_state() or restore() change what it trains"
    ) -> None:
        self.__doc__ = doc
        self.change = change

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> Owned[T]: ...

    @overload
    def __get__(self, instance: object, owner: type | None = None) -> T: ...

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        return self if instance is None else getattr(instance._owner, self.name)

    def __set__(self, instance: Any, value: Any) -> None:
        raise AttributeError(self._read_only(instance))

    def __delete__(self, instance: Any) -> None:
        raise AttributeError(self._read_only(instance))

    def _read_only(self, instance: Any) -> str:
        return f"{self.name} is read-only: the {type(instance).__name__} keeps it; {self.change}."
