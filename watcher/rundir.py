"""The run directory of `watcher run`: its layout, file names and formats, declared once.

Every file Watcher puts in a run directory is named here and nowhere else;
the ranks, the replays, the launcher side and the readers all go through
`RunDir` (the whole directory) and `ReplayDir` (one round of replays).

    DIR/run.json                         this directory's format version (FORMAT_VERSION), the command
    DIR/recording.duckdb                 the recording (schema: watcher/schema.py)
    DIR/runtime/control                  the node's control block (runtime/control.py)
    DIR/runtime/rank<r>.steps.jsonl      a rank's log: collective lines (they carry "seq") and step lines
    DIR/runtime/rank<r>.error            a rank's runtime failure (fail open), if any
    DIR/runtime/rank<r>.skipped.jsonl    samples a skip_batch prescription kept out
    DIR/runtime/rank<r>.audits.jsonl     a rank's SDC audits, one line each (runtime/audit.py)
    DIR/runtime/rank<r>.preflight.json   what `watcher preflight` learned inside rank r
    DIR/runtime/incident.<seq>.json      an incident as opened by a rank (kind, step, halt step)
    DIR/runtime/crash_replay.rank<r>.step<k>.json   a replay (or resume) order for an orphaned snapshot
    DIR/runtime/rescue/death.rank<r>.pid<p>.json    a rank's death, said by its supervisor (runtime/supervisor.py)
    DIR/runtime/rescue/fate.rank<r>.pid<p>.json     the launcher's answer: replace or let go (rescue.py)
    DIR/runtime/rescue/orphan.rank<r>.step<k>       a snapshot of rank r at step k, orphaned and awaiting orders
    DIR/runtime/rescue/cause.rank<r>.json           why Watcher ended rank r itself (a stuck rank, to be replaced)
    DIR/incidents/<id>.json              the incident document (watcher/incident.py), one writer
    DIR/incidents/<id>/                  the incident's replays (a ReplayDir), with
        from-copy/                       the replay from a state copy (a ReplayDir)
        diagnosis/round<n>.json, done.json, <variant>/ (a ReplayDir), reproducer/
        rediagnosis-<n>/                 `watcher diagnose` after the run
    DIR/audit.json                       the audits' account: windows, coverage, findings, cost
    DIR/audits/<n>/                      audit n's replays (a ReplayDir; a clean audit leaves only its logs)
    DIR/incidents/affinity/rank<r>.json  a rank's CPU set, said before a diagnosis
    DIR/retained/rank<r>.json            a snapshot kept after the run for `watcher diagnose`
    DIR/retained/window/, orders/rank<r>/  its window and the orders it takes
    DIR/quarantine.json                  devices the run stopped using
    DIR/health.jsonl                     the run's device health ledger (watcher/health.py)

A ReplayDir holds, per rank: arrive.rank<r>.json (what it holds at the halt),
replayed.rank<r>.json (how its replay ended), rank<r>.result.pt (the replay's
result), rank<r>.replay.log, rank<r>.sandbox.jsonl, merged.rank<r>.json (its
merge), rank<r>.crash_replay.json (an orphan's reply); and plan.json,
outcome.json, recovery.json for the round.

JSON files are written whole through an atomic rename, so a reader never
sees half a file.  The JSON-lines logs are appended; a reader skips a line
still being written.

On a multi-node job every node has its own run directory with this layout.
The documents ranks trade during an incident (arrivals, plans, replay
outcomes and results, merges, verdicts, the incident document) go through
`RunDir.put`/`get`/`has`, which also publish them in the job's c10d store
(`shared`, under run/<path>) and mirror what other nodes wrote into this
node's directory, so each node's directory holds the whole incident.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from .errors import RecordingError

FORMAT_VERSION = 1
# A rank stopped by Watcher after an incident (EX_TEMPFAIL): the launcher sees
# it as a failed rank; `watcher run` knows it is not a crash.
STOP_EXIT_CODE = 75
# Reading a long run's log: an incident needs the last snapshot interval, not
# the whole history (100k steps are tens of MB of JSON, seconds to parse).
TAIL_BLOCK = 1 << 20


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}.{threading.get_ident()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def read_json(path: Path):
    with open(path) as f:
        return json.load(f)


def read_json_or_none(path: Path):
    """A JSON file's content, or None while it does not exist (or is not whole yet)."""
    try:
        return read_json(path)
    except (OSError, ValueError):
        return None


def control_file(runtime_dir: Path) -> Path:
    """The node's control block (runtime/control.py)."""
    return Path(runtime_dir) / "control"


def opened_incident_file(runtime_dir: Path, seq: int) -> Path:
    """An incident as a rank opened it (kind, steps, detail), before any verdict."""
    return Path(runtime_dir) / f"incident.{seq}.json"


def exchange_dir(window_dir: Path, tag: str) -> Path:
    """Where the ranks' replays of one round trade collective inputs
    (replay/exchange.py): in the window directory, tmpfs, never on disk."""
    return Path(window_dir) / f"exchange-{tag}"


class ReplayDir:
    """One round of replays, every rank's files side by side."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def make(self) -> "ReplayDir":
        self.path.mkdir(parents=True, exist_ok=True)
        return self

    def arrive(self, rank: int) -> Path:
        return self.path / f"arrive.rank{rank}.json"

    def replayed(self, rank: int) -> Path:
        return self.path / f"replayed.rank{rank}.json"

    def result(self, rank: int) -> Path:
        return self.path / f"rank{rank}.result.pt"

    def replay_log(self, rank: int) -> Path:
        return self.path / f"rank{rank}.replay.log"

    def sandbox_log(self, rank: int) -> Path:
        return self.path / f"rank{rank}.sandbox.jsonl"

    def sandbox_logs(self) -> list[tuple[int, Path]]:
        return sorted((int(p.name[4:].split(".")[0]), p) for p in self.path.glob("rank*.sandbox.jsonl"))

    def merged(self, rank: int) -> Path:
        return self.path / f"merged.rank{rank}.json"

    def crash_reply(self, rank: int) -> Path:
        return self.path / f"rank{rank}.crash_replay.json"

    def crash_site(self, rank: int) -> Path:
        """Where the rank's replay writes its frames if it dies of a fatal signal (runtime/crashsite.py)."""
        return self.path / f"rank{rank}.crash.txt"

    def reply(self, rank: int) -> Path:
        """An orphaned or retained snapshot's reply to an order given as a file."""
        return self.path / f"rank{rank}.reply.json"

    @property
    def plan(self) -> Path:
        return self.path / "plan.json"

    @property
    def outcome(self) -> Path:
        return self.path / "outcome.json"

    @property
    def recovery(self) -> Path:
        return self.path / "recovery.json"

    @property
    def exchange(self) -> Path:
        return self.path / "exchange"

    @property
    def summary(self) -> Path:
        return self.path / "result.json"


class IncidentDir(ReplayDir):
    """An incident's own directory: its replays, the state copy's, the diagnosis'."""

    @property
    def closed(self) -> Path:
        return self.path / "closed.json"

    @property
    def from_copy(self) -> ReplayDir:
        return ReplayDir(self.path / "from-copy")

    @property
    def diagnosis(self) -> Path:
        return self.path / "diagnosis"

    def diagnosis_round(self, n: int) -> Path:
        return self.diagnosis / f"round{n}.json"

    @property
    def diagnosis_done(self) -> Path:
        return self.diagnosis / "done.json"

    def variant(self, name: str) -> ReplayDir:
        return ReplayDir(self.diagnosis / name)

    @property
    def reproducer(self) -> Path:
        return self.diagnosis / "reproducer"

    def new_rediagnosis(self) -> Path:
        n = 1 + len(list(self.path.glob("rediagnosis-*")))
        return self.path / f"rediagnosis-{n}"


class RunDir:
    """A `watcher run` directory."""

    def __init__(self, root: Path, shared=None):
        self.root = Path(root)
        self.shared = shared  # the job's store (runtime/nodes.py) on a multi-node job
        self.recording = self.root / "recording.duckdb"
        self.runtime = self.root / "runtime"
        self.incidents = self.root / "incidents"
        self.retained = self.root / "retained"
        self.quarantine = self.root / "quarantine.json"
        self.health_log = self.root / "health.jsonl"
        self.manifest = self.root / "run.json"

    def __str__(self) -> str:
        return str(self.root)

    def __fspath__(self) -> str:
        return str(self.root)

    # -- making and opening ---------------------------------------------------------------
    def create(self, cmd: list[str]) -> None:
        """Make the directory (mode 0700) with its manifest; it must not exist."""
        self.root.mkdir(mode=0o700, parents=True)
        self.runtime.mkdir()
        self.incidents.mkdir()
        write_json(self.manifest, {"format": "watcher-run", "version": FORMAT_VERSION, "cmd": list(cmd),
                                   "created": time.time()})

    def check(self) -> "RunDir":
        """Refuse what is not a run directory, or one of an unknown format version."""
        if not self.incidents.is_dir():
            raise RecordingError(f"{self.root} is not a `watcher run` directory (no incidents/)")
        try:
            man = read_json(self.manifest)
        except FileNotFoundError:
            raise RecordingError(f"{self.root} has no run.json: not a `watcher run` directory of this version")
        except (OSError, ValueError) as e:
            raise RecordingError(f"{self.manifest} is unreadable: {e}") from None
        if man.get("format") != "watcher-run" or man.get("version") != FORMAT_VERSION:
            raise RecordingError(f"{self.root} is run-directory format {man.get('version')!r}; this Watcher "
                                 f"reads version {FORMAT_VERSION}")
        return self

    # -- documents the ranks trade (through the job's store on many nodes) ------------------------
    def key(self, path: Path) -> str:
        """A document's key in the job's store."""
        return "run/" + str(Path(path).relative_to(self.root))

    def put(self, path: Path, obj) -> None:
        write_json(path, obj)
        if self.shared is not None:
            self.shared.set(self.key(path), json.dumps(obj, default=str))

    def get(self, path: Path, mirror: bool = False):
        """The document: the job's copy on many nodes, else the file.  With
        `mirror` the job's copy is also written here (a node's leader does
        that once the incident is over: earlier, a stale copy read from the
        store could overwrite a newer one this node just wrote)."""
        if self.shared is not None and self.shared.check([self.key(path)]):
            obj = json.loads(self.shared.get(self.key(path)))
            if mirror:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_json(path, obj)
            return obj
        return read_json(path)

    def has(self, path: Path) -> bool:
        return self.has_all([path])

    def has_all(self, paths: list[Path]) -> bool:
        missing = [p for p in paths if not Path(p).exists()]
        if not missing:
            return True
        return self.shared is not None and self.shared.check([self.key(p) for p in missing])

    def put_bytes(self, path: Path, data: bytes) -> None:
        """Bytes for the other nodes only (this node has the file they come from)."""
        if self.shared is not None:
            self.shared.set(self.key(path), data)

    def get_bytes(self, path: Path) -> bytes:
        if Path(path).exists():
            return Path(path).read_bytes()
        if self.shared is not None and self.shared.check([self.key(path)]):
            return self.shared.get(self.key(path))
        raise FileNotFoundError(path)

    # -- written by the ranks -----------------------------------------------------------------
    def rank_process(self, rank: int) -> Path:
        """Which process is rank r: {"pid", "start_ticks"} (the launcher watches it, rank_deaths.py)."""
        return self.runtime / f"rank{rank}.process.json"

    def rank_process_files(self) -> list[tuple[int, Path]]:
        return sorted((int(p.name[4:].split(".")[0]), p) for p in self.runtime.glob("rank*.process.json"))

    def steps_log(self, rank: int) -> Path:
        return self.runtime / f"rank{rank}.steps.jsonl"

    def crash_site(self, rank: int) -> Path:
        """Where the live rank writes its frames if it dies of a fatal signal (runtime/crashsite.py)."""
        return self.runtime / f"rank{rank}.crash.txt"

    def logged_ranks(self) -> list[int]:
        return sorted({int(p.name[4:].split(".")[0]) for p in self.runtime.glob("rank*.steps.jsonl")})

    def preflight_file(self, rank: int) -> Path:
        """What `watcher preflight` learned inside rank r (runtime/preflight_probe.py)."""
        return self.runtime / f"rank{rank}.preflight.json"

    def preflight_files(self) -> list[tuple[int, Path]]:
        return sorted((int(p.name[4:].split(".")[0]), p) for p in self.runtime.glob("rank*.preflight.json"))

    def audit_log(self, rank: int) -> Path:
        return self.runtime / f"rank{rank}.audits.jsonl"

    @property
    def audit_summary(self) -> Path:
        return self.root / "audit.json"

    def audit_dir(self, seq: int) -> ReplayDir:
        return ReplayDir(self.root / "audits" / str(seq))

    def error_log(self, rank: int) -> Path:
        return self.runtime / f"rank{rank}.error"

    @property
    def job(self) -> Path:
        """The job as this node's ranks see it: {"world", "local_ranks"}, and on
        many nodes "node", "nodes", "master_addr", "master_port", "run_id"."""
        return self.runtime / "job.json"

    def refusal(self, rank: int) -> Path:
        """Why protection (snapshots, replay) is off for a rank, when it is."""
        return self.runtime / f"rank{rank}.unprotected.json"

    def refusals(self) -> list[dict]:
        out = []
        for p in sorted(self.runtime.glob("rank*.unprotected.json")):
            try:
                out.append(read_json(p))
            except (OSError, ValueError):
                continue
        return out

    def skipped_log(self, rank: int) -> Path:
        return self.runtime / f"rank{rank}.skipped.jsonl"

    def drill_file(self, name: str) -> Path:
        return self.runtime / f"drill.{name}"

    def opened_incident(self, seq: int) -> Path:
        return opened_incident_file(self.runtime, seq)

    @property
    def control(self) -> Path:
        return control_file(self.runtime)

    def opened_incidents(self) -> list[tuple[int, Path]]:
        return sorted((int(p.name.split(".")[1]), p) for p in self.runtime.glob("incident.*.json"))

    def crash_order(self, rank: int, step: int) -> Path:
        return self.runtime / f"crash_replay.rank{rank}.step{step}.json"

    # -- rescue (watcher run --rescue: runtime/supervisor.py, rescue.py) ------------------------
    @property
    def rescue(self) -> Path:
        return self.runtime / "rescue"

    def rescue_death(self, rank: int, pid: int) -> Path:
        return self.rescue / f"death.rank{rank}.pid{pid}.json"

    def rescue_deaths(self) -> list[Path]:
        return sorted(self.rescue.glob("death.rank*.json"))

    def rescue_fate(self, rank: int, pid: int) -> Path:
        return self.rescue / f"fate.rank{rank}.pid{pid}.json"

    def rescue_cause(self, rank: int) -> Path:
        """Why Watcher itself ended rank r (a stuck rank whose hang replayed clean), for its rescue."""
        return self.rescue / f"cause.rank{rank}.json"

    def rescue_orphan(self, rank: int, step: int) -> Path:
        return self.rescue / f"orphan.rank{rank}.step{step}"

    # -- incidents ----------------------------------------------------------------------------
    def incident_path(self, incident_id: str) -> Path:
        return self.incidents / f"{incident_id}.json"

    def incident_dir(self, incident_id: str) -> IncidentDir:
        return IncidentDir(self.incidents / incident_id)

    def incident_paths(self) -> list[Path]:
        return sorted(self.incidents.glob("inc-*.json"))

    def next_incident_id(self) -> str:
        """An id after every incident a rank opened or the run wrote."""
        seqs = [s for s, _ in self.opened_incidents()]
        return f"inc-{max(seqs + [len(self.incident_paths())]) + 1:04d}"

    def affinity(self, rank: int) -> Path:
        return self.incidents / "affinity" / f"rank{rank}.json"

    # -- retained snapshots ---------------------------------------------------------------------
    @property
    def retained_window(self) -> Path:
        return self.retained / "window"

    def retained_orders(self, rank: int) -> Path:
        return self.retained / "orders" / f"rank{rank}"

    def retained_info(self, rank: int) -> Path:
        return self.retained / f"rank{rank}.json"

    def retained_infos(self) -> list[Path]:
        return sorted(self.retained.glob("rank*.json"))

    # -- reading the ranks' logs ------------------------------------------------------------------
    def read_steps(self, rank: int, since: int | None = None) -> dict[int, dict]:
        """A rank's step fingerprints by step (the last line of a step wins:
        a recovered step is logged again)."""
        return _read_jsonl(self.steps_log(rank), lambda fp: fp["step"], since, lambda rec: "seq" not in rec)

    def read_colls(self, rank: int, since: int | None = None) -> dict[tuple, dict]:
        """A rank's logged collectives by (group, seq): the log lines that carry a sequence number."""
        return _read_jsonl(self.steps_log(rank), lambda c: (c["group"], c["seq"]), since, lambda rec: "seq" in rec)


def live_snapshots(steps_log: Path) -> list[int]:
    """The snapshot steps of a rank's present timeline: those logged since the
    last rescue resumed it (a step line marked "resumed"), whose older
    snapshots went with the processes that held them."""
    found: list[int] = []
    try:
        with open(steps_log, "rb") as f:
            for line in f:
                if b'"snapshot": true' not in line and b'"resumed"' not in line:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if "seq" in rec:
                    continue
                if "resumed" in rec:
                    found = []
                if rec.get("snapshot"):
                    found.append(rec["step"])
    except OSError:
        return []
    return sorted(set(found))


def read_steps(run_dir: Path, rank: int, since: int | None = None) -> dict[int, dict]:
    return RunDir(run_dir).read_steps(rank, since)


def read_colls(run_dir: Path, rank: int, since: int | None = None) -> dict[tuple, dict]:
    return RunDir(run_dir).read_colls(rank, since)


def _read_jsonl(path: Path, key, since: int | None = None, keep=None) -> dict:
    """A JSON-lines log keyed by key(record), the records `keep` accepts
    (default all); a line still being written is skipped.  With `since` (a
    step) only the log's tail back to that step is read."""
    try:
        with open(path, "rb") as f:
            if since is None:
                data = f.read()
            else:
                end = f.seek(0, os.SEEK_END)
                start = end
                while start > 0:
                    start = max(0, start - TAIL_BLOCK)
                    f.seek(start)
                    if start:
                        f.readline()  # a partial first line
                    line = f.readline()
                    try:
                        first = json.loads(line).get("step")
                    except ValueError:
                        first = None
                    # A margin: recovered steps are logged again later, out of order.
                    if first is not None and first < since - 64:
                        break
                f.seek(start)
                if start:
                    f.readline()
                data = f.read(end - f.tell())
    except OSError:
        return {}
    out = {}
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if keep is None or keep(rec):
            out[key(rec)] = rec
    return out
