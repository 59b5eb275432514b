"""The incident document (DIR/incidents/<id>.json): one typed object, one writer.

An incident is born with what the detector saw, before any verdict
(`Incident.opened`); the verdict (replay/verdict.py), the recovery
(replay/recovery.py), the diagnosis (replay/diagnose.py) and the applied
prescription fill in their fields.  Every stage reads the document with
`load_incident` and writes it with `save_incident`; `watcher run` loads every
document into the recording's `incident` and `causal_link` tables through
watcher/store.py.  Field meanings are those of the `incident` table
(watcher/schema.py); the JSON carries more detail than the table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from .errors import RecordingError
from .rundir import RunDir, read_json

INCIDENT_VERSION = 1


@dataclass
class Incident:
    incident_id: str
    kind: str                          # non_finite, loss_spike, sdc, hang, crash, collective_error, replay_check
    detected_step: int | None
    detected_rank: int | None
    detected_ts: int | None            # CLOCK_MONOTONIC ns
    detail: dict | None                # what the detector saw
    window: dict                       # {"from_step", "to_step"}: the replayed window
    replay: dict | None = None         # reproduced, exact, first_divergence, stall, per_rank, reason...
    classification: str | None = None  # transient | persistent | None (unclassified)
    track: str | None = None           # A (recover) | B (diagnose)
    transient_cause: str | None = None  # bit_flip, communication, timeout, unknown
    attribution: dict | None = None    # {"cause", "confidence", "evidence"} (Track B)
    causal_chain: list | None = None   # links, root cause first (Track B)
    prescription: dict | None = None   # {"action", ...}: skip_batch, adjust_params, quarantine_device, fix_kernel
    recovered: bool = False
    resumed_at_step: int | None = None
    steps_lost: int | None = None
    recovery: dict | None = None       # possible, reason, merged, detect_to_resume_s...
    escalated: dict | None = None      # transients on one rank escalated to persistent
    snapshot: dict | None = None       # the snapshot kept for diagnosis
    diagnosis: dict | None = None      # the counterfactual replays and what they showed
    recorder_view: dict | None = None  # where the recorder saw each rank blocked (no replay possible)
    version: int = INCIDENT_VERSION

    @classmethod
    def opened(cls, incident_id: str, kind: str, step, rank, ts, detail, from_step, to_step,
               reason: str | None = None) -> "Incident":
        """The document before any verdict; with `reason`, why there is no replay."""
        return cls(incident_id, kind, step, rank, ts, detail, {"from_step": from_step, "to_step": to_step},
                   replay=None if reason is None else {"reproduced": None, "first_divergence": None,
                                                      "reason": reason})

    @classmethod
    def unclassified(cls, info: dict, plan: dict, reason: str | None) -> "Incident":
        """From an opened incident's info (runtime/control.py) and its replay plan."""
        return cls.opened(info["incident_id"], info["kind"], info["failing_step"], info["rank"], info["detected_ts"],
                          info.get("detail"), plan.get("from_step"), plan.get("to_step"), reason)

    def update(self, **changes) -> None:
        for name, value in changes.items():
            if name not in _FIELDS:
                raise AttributeError(f"an incident has no field {name!r}")
            setattr(self, name, value)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict) -> "Incident":
        if doc.get("version", INCIDENT_VERSION) != INCIDENT_VERSION:
            raise RecordingError(f"incident {doc.get('incident_id')} is document version {doc.get('version')}; "
                                 f"this Watcher reads version {INCIDENT_VERSION}")
        unknown = set(doc) - _FIELDS
        if unknown:
            raise RecordingError(f"incident {doc.get('incident_id')} has unknown fields {sorted(unknown)}")
        return cls(**doc)


_FIELDS = {f.name for f in fields(Incident)}


def save_incident(run_dir: RunDir, inc: Incident) -> None:
    """The one writer of incident documents (atomic: a reader never sees half of one)."""
    run_dir.put(run_dir.incident_path(inc.incident_id), inc.to_dict())


def load_incident(run_dir: RunDir, incident_id: str, mirror: bool = False) -> Incident:
    """The document; with `mirror`, also copied into this node's run directory (RunDir.get)."""
    return Incident.from_dict(run_dir.get(run_dir.incident_path(incident_id), mirror=mirror))


def load_incidents(run_dir: RunDir) -> list[Incident]:
    return [Incident.from_dict(read_json(p)) for p in run_dir.incident_paths()]
