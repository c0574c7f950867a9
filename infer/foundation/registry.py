"""Name -> class registries: how a config string selects a proposer or a training objective.

One helper serves both (``infer.proposers.base.PROPOSERS``, ``train.objectives.base.OBJECTIVES``):
classes register themselves with ``@REGISTRY.register("name")`` in their own module, and a lookup
first imports every module of the registry's package, so nothing else keeps a list of what is
implemented and nothing branches on a method string (the schema's list of vLLM's method names,
``spec_config.METHODS``, says what a config may name, not what is served). A name registered twice is an error, whichever module
comes second.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, Generic, TypeVar

from infer.foundation.validation import config_error

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    """Classes by name. ``package``: the dotted package whose modules register into it;
    ``key`` / ``where`` / ``allowed``: how a bad name is reported (the config key, its section,
    and what is allowed, with ``{names}`` for the registered names)."""

    def __init__(self, package: str, key: str, where: str,
                 allowed: str = "one of {names}") -> None:
        self.package, self.key, self.where, self.allowed = package, key, where, allowed
        self._classes: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator: make ``cls`` available as ``name`` (sets ``cls.name``)."""

        def wrap(cls: T) -> T:
            if name in self._classes:
                raise ValueError(f"{self.package}: {name!r} is registered twice "
                                 f"({self._classes[name].__qualname__} and {cls.__qualname__})")
            cls.name = name
            self._classes[name] = cls
            return cls

        return wrap

    def get(self, name: str) -> T:
        """The class registered as ``name``; a clear error lists the registered names."""
        self.load_all()
        if name not in self._classes:
            raise config_error(self.key, name, self.allowed.format(names=", ".join(self.names())),
                               self.where)
        return self._classes[name]

    def names(self) -> list[str]:
        self.load_all()
        return sorted(self._classes)

    def load_all(self) -> None:
        """Import every module of the package so its ``register`` decorators run."""
        pkg = importlib.import_module(self.package)
        for info in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{self.package}.{info.name}")

    def unregister(self, name: str) -> None:
        """Drop ``name`` (tests use it to hide a method)."""
        self._classes.pop(name, None)
