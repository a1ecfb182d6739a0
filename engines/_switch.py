"""Choosing a vendor module at run time: an override, an in-repo stand-in, or the real one.

The CUDA layer (cuda-python vs :mod:`engines.testing.fake_cuda`) and the TensorRT backend
(``tensorrt`` vs :mod:`engines.testing.fake_trt`) pick their module the same way; this is that
one mechanism. Nothing is imported until :meth:`ModuleSwitch.current` is first called.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from types import ModuleType

__all__ = ["ModuleSwitch"]


class ModuleSwitch:
    """Which module to use now: the override set with :meth:`use`, else the stand-in when the
    environment variable ``env_var`` is ``1``, else ``load_real()``.

    Args:
        env_var: Selects the stand-in when set to ``1``.
        standin: Import path of the stand-in module.
        load_real: Imports the real module; raises the package's "unavailable" error if absent.
    """

    def __init__(self, env_var: str, standin: str, load_real: Callable[[], ModuleType]) -> None:
        self.env_var = env_var
        self.standin = standin
        self.load_real = load_real
        self.override: ModuleType | None = None

    def current(self) -> ModuleType:
        if self.override is not None:
            return self.override
        if os.environ.get(self.env_var, "") == "1":
            return importlib.import_module(self.standin)
        return self.load_real()

    def is_standin(self, unavailable: type[Exception]) -> bool:
        """True when the current module is a stand-in (``IS_STANDIN``); False when none is
        available (``unavailable`` raised)."""
        try:
            return bool(getattr(self.current(), "IS_STANDIN", False))
        except unavailable:
            return False

    @contextlib.contextmanager
    def use(self, module: ModuleType | None) -> Iterator[None]:
        """Use ``module`` inside the ``with`` block (e.g. the stand-in in tests)."""
        previous = self.override
        self.override = module
        try:
            yield
        finally:
            self.override = previous
