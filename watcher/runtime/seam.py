"""The seam between the in-rank runtime and replay: what replay may read of a
rank, and what it may ask the rank to do.

The runtime (rank.py) owns the rank's state; replay (watcher.replay: the
incident protocol, snapshots, replays, verdicts, recovery, diagnosis) is
handed the rank as a `Rank` and uses nothing else of it.  Replay never
assigns an attribute of the rank: every change it needs is one of the
requests below, carried out by the runtime.  tests/test_structure.py holds
replay to this list.

Replay may also import the runtime's leaf modules, which hold no rank state:
checksum, collectives (its public names), control, crashsite, supervisor, training, window, wordsum.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Rank(Protocol):
    # -- what replay may read ---------------------------------------------------------------
    rank: int
    world: int
    local_ranks: list        # the global ranks on this node
    run_dir: Path            # the run directory's root
    rundir: object           # the same, as a watcher.rundir.RunDir
    window_dir: Path         # the replay window's segments (tmpfs)
    policy: str              # observe | recover | apply
    step: int                # the last completed step
    fetch_idx: int           # batches fetched so far
    main_opt: object         # the optimizer that delimits steps
    modules: dict | None     # id -> module owning the main optimizer's parameters
    schedulers: list | None  # LR schedulers of the main optimizer
    groups: list             # the watched process groups (collectives.WatchedGroup)
    detectors: object        # analysis.detectors.Detectors
    replicated: bool | None  # do all ranks hold identical parameters (DDP)?
    unsupported: str | None  # why this rank cannot be replayed, if it cannot
    window_gap: int          # the last step run paused: no replay crosses it
    copies: object           # replay.state_copy.StateCopies or None
    snap_policy: object      # replay.snapshot.SnapshotPolicy
    step_ns: list            # recent step durations
    param_sum: object        # checksum.ParamChecksum
    grad_norm: object        # checksum.ReducedGradNorm
    fault_hooks: list        # drills only: (stage, fn)
    ctl: object              # the node's control block: the incident protocol's shared words

    def params(self) -> list: ...
    def snapshot_at(self, step: int): ...
    def usable_snapshots(self) -> list[int]: ...
    def counters(self) -> dict: ...

    # -- what replay may ask the rank to do ----------------------------------------------------
    def flush(self) -> None:
        """Everything logged so far, and the window, reach their files."""

    def incident_handled(self, seq: int) -> None:
        """This rank is done halting for incident `seq`."""

    def retain_snapshot(self, step: int, incident_id: str) -> None:
        """Keep the snapshot of `step` out of rotation, for diagnosis."""

    def restart_history(self) -> None:
        """The snapshots and copies hold a faulty past: drop them, snapshot anew."""

    def adopt_recovered_steps(self, fingerprints: list[dict], last_step: int, param_sum: int) -> None:
        """Log the replayed fingerprints as the record of the recovered steps."""

    def apply_prescription(self, prescription: dict, incident_id: str) -> None:
        """Carry out a prescription from now on (runtime/remedies.py)."""

    def stop_after_incident(self, incident_id: str) -> None:
        """Stop this rank cleanly (exit STOP_EXIT_CODE); never returns."""

    def go_quiet(self) -> None:
        """In a snapshot process: no hook runs any more."""

    def enter_replay(self, state) -> None:
        """In a replay child: run the training loop in replay mode, served by `state`."""

    def resume_live(self, order: dict) -> None:
        """In a snapshot taken over as the live rank (watcher/rescue.py): rejoin
        the job on a rebuilt transport and go on training from the snapshot's step."""

    def restore_counters(self, counters: dict) -> None:
        """In a replay child: step, batch and collective counters as of a state copy."""
