"""The Watcher runtime: what runs inside every rank under `watcher run`.

It is injected with no change to the user's code: `watcher run` puts
`site/sitecustomize.py` on PYTHONPATH, which chains to any existing
sitecustomize and then arms an import hook.  When the rank imports torch the
runtime installs global hooks (optimizer step, backward, DataLoader, process
group creation) and from then on, per step, it records the loss, grad norm,
batch digest, parameter checksum, RNG digest and every collective's input
checksum and output, takes fork snapshots, runs the detectors, and on an
incident halts every rank at a step boundary for a sandboxed replay.

Every hook is fail-open: an exception inside Watcher disables Watcher in that
rank (and is written to the rank's runtime error file); training goes on.
"""
