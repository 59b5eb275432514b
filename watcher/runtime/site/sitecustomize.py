"""Injected by `watcher run` through PYTHONPATH; arms the Watcher runtime.

Chains to the sitecustomize this one shadows, so a site's own customisation
still runs.  Anything that goes wrong here is swallowed: a Watcher problem must
never stop the user's program from starting.
"""
import os
import sys


def _chain_to_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    import importlib.util

    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        cand = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(cand):
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", cand)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return


def _arm() -> None:
    root = os.environ.get("WATCHER_PACKAGE_ROOT")
    if root and root not in sys.path:
        sys.path.append(root)
    from watcher.runtime import bootstrap

    bootstrap.arm()


try:
    _chain_to_shadowed()
except Exception as e:  # the shadowed file's own failure is reported, not fatal
    print(f"watcher: sitecustomize chained from PYTHONPATH failed: {e}", file=sys.stderr)
if os.environ.get("WATCHER_RUN_DIR"):
    try:
        _arm()
    except Exception as e:
        print(f"watcher: runtime not armed: {e}", file=sys.stderr)
