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
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            # One shot, taken when torch is really imported (a library that only
            # asks whether torch exists, importlib.util.find_spec, gets here too
            # and must not use it up).
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _split_safely()
            real_exec(module)
            _install_safely()

        spec.loader.exec_module = exec_module
        return spec


def _split_safely() -> None:
    """A rank of a rescued job splits from its supervisor as it starts
    importing torch, not after: the supervisor (the process the launcher
    watches, runtime/supervisor.py) then never holds torch, and costs a bare
    interpreter's memory instead of a copy of the rank's."""
    try:
        # Imported here, not at the top: this module loads in every Python
        # process of the job (sitecustomize), most of which never import torch.
        import os
        from pathlib import Path

        from . import supervisor  # no torch in it (nor in rundir): the supervisor stays bare
        from ..rundir import RunDir  # as above

        if supervisor.wanted():
            supervisor.split(RunDir(Path(os.environ["WATCHER_RUN_DIR"])))
    except Exception as e:  # fail open: not split, so not rescued; training goes on
        print(f"watcher: rank not supervised in pid {__import__('os').getpid()}: {e}", file=sys.stderr)


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
