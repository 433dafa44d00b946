"""Lazy package faces (PEP 562): a public name is imported on first use, not with the package.

``import stepwatch`` or ``import stepwatch.store.reader`` must not load PyTorch: the CLI's read
commands and the dashboard never train. Each package lists where its public names live and
installs the ``__getattr__``/``__dir__`` pair this module builds.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__: list[str] = []


def lazy_face(
    package: str,
    namespace: dict[str, Any],
    names: Mapping[str, str],
    submodules: Iterable[str] = (),
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``.

    Args:
        package: the package's ``__name__``.
        namespace: the package's ``globals()``; a loaded name is cached there, so the next
            access is an ordinary attribute lookup.
        names: public name -> the module (relative to ``package``) that defines it.
        submodules: submodules that ``dir()`` lists and attribute access imports, as an eager
            ``__init__`` would have made them available.
    """
    subs = frozenset(submodules)

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module, package), name)
        elif name in subs:
            value = importlib.import_module(f".{name}", package)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names) | subs)

    return __getattr__, __dir__
