"""Install the runtime the moment the rank has imported torch.

sitecustomize runs before the user's program and must not import torch itself
(most Python processes in a job, torchrun's launcher included, never train,
and importing torch costs a second).  A meta-path finder waits for the import
of `torch` to finish and then installs the hooks; until a process actually
steps an optimizer, the hooks do nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_armed = False


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)  # one shot; let the real finders resolve torch
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            _install_safely()

        spec.loader.exec_module = exec_module
        return spec


def _install_safely() -> None:
    try:
        from . import rank  # only once torch is imported: most processes of a job never train

        rank.install()
    except Exception as e:  # fail open: training goes on without Watcher
        print(f"watcher: runtime disabled in pid {__import__('os').getpid()}: {e}", file=sys.stderr)


def arm() -> None:
    global _armed
    if _armed:
        return
    _armed = True
    if "torch" in sys.modules:
        _install_safely()
    else:
        sys.meta_path.insert(0, _AfterTorchImport())
