"""`watcher run`: launch a training command with the recorder and the in-rank runtime.

    DIR/recording.duckdb     the eBPF recording, plus the runtime's tables
                             (step, collective_io, incident, sandbox_event)
    DIR/runtime/             per-rank step and collective logs, the control block
    /dev/shm/watcher-window-*  replay window segments while the job runs (tmpfs)
    DIR/incidents/<id>.json  one document per incident, with its replay verdict

The runtime reaches every Python rank through a sitecustomize put first on
PYTHONPATH (it chains to any existing one); the user's files are not touched.
After the job ends, a rank that crashed is replayed from its newest snapshot
(which outlives the rank for a short while) to see whether it crashes again.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from .errors import RecordingError, UsageError
from .runtime.control import write_json
from .store import insert_rows

POLICIES = ("observe", "recover", "apply")
SITE_DIR = Path(__file__).resolve().parent / "runtime" / "site"
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
PR_SET_CHILD_SUBREAPER = 36
STOPPED_BY_WATCHER = 75


@dataclass
class RunConfig:
    cmd: list[str]
    out: Path
    policy: str = "recover"
    snapshot_budget: float = 1.0        # percent of step time
    snapshot_interval: int | None = None
    copy_interval: int | None = None    # state copies between snapshots: None adapts to the budget, 0 is off
    detect: dict = field(default_factory=dict)
    inject: dict | list | None = None   # drills only: one fault or several
    replay_check: int | None = None     # replay the window ending at this step, healthy or not
    retain_s: float = 300.0             # a persistent incident's snapshots outlive the run this long
    quiet: bool = False

    def validate(self) -> None:
        if not self.cmd:
            raise UsageError("nothing to run: give a command after --, e.g. watcher run -- torchrun train.py")
        if self.policy not in POLICIES:
            raise UsageError(f"unknown --policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        if not 0 < self.snapshot_budget <= 100:
            raise UsageError("--snapshot-budget is a percentage of step time, in (0, 100]")
        if self.snapshot_interval is not None and self.snapshot_interval < 1:
            raise UsageError("--snapshot-interval must be at least 1 step")
        if self.copy_interval is not None and self.copy_interval < 0:
            raise UsageError("--copy-interval is a number of steps (0 turns state copies off)")
        if not 0 <= self.retain_s <= 86400:
            raise UsageError("--retain is in seconds, from 0 (keep nothing) to 86400")

    def env(self) -> dict:
        env = dict(os.environ)
        prev = env.get("PYTHONPATH")
        env["PYTHONPATH"] = str(SITE_DIR) + (os.pathsep + prev if prev else "")
        env["WATCHER_PACKAGE_ROOT"] = str(PACKAGE_ROOT)
        env["WATCHER_RUN_DIR"] = str(self.out.resolve())
        env["WATCHER_POLICY"] = self.policy
        env["WATCHER_SNAPSHOT_BUDGET"] = str(self.snapshot_budget)
        env["WATCHER_RETAIN_S"] = str(self.retain_s)
        if self.snapshot_interval:
            env["WATCHER_SNAPSHOT_INTERVAL"] = str(self.snapshot_interval)
        if self.copy_interval is not None:
            env["WATCHER_COPY_INTERVAL"] = str(self.copy_interval)
        else:
            env.pop("WATCHER_COPY_INTERVAL", None)
        if self.replay_check is not None:
            env["WATCHER_REPLAY_CHECK"] = str(self.replay_check)
        else:
            env.pop("WATCHER_REPLAY_CHECK", None)
        if self.detect:
            env["WATCHER_DETECT"] = json.dumps(self.detect)
        if self.inject:
            env["WATCHER_INJECT"] = json.dumps(self.inject)
        else:
            env.pop("WATCHER_INJECT", None)
        from .runtime import wordsum
        from .uprobes.tensor_layout import CACHE

        lib = wordsum.build(CACHE)  # one-pass checksums; without it the ranks sum with torch
        if lib is not None:
            env[wordsum.ENV] = str(lib)
        else:
            env.pop(wordsum.ENV, None)
        return env


@dataclass
class RunResult:
    out: Path
    exit_code: int
    incidents: list[dict]
    steps: int


def parse_detect(items: list[str]) -> dict:
    from .analysis.detectors import Detectors

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"bad --detect {item!r}: use KEY=VALUE, e.g. --detect hang_seconds=60")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    try:
        Detectors.from_dict(out)
    except (ValueError, TypeError) as e:
        raise UsageError(f"bad --detect: {e}") from None
    return out


def run(cfg: RunConfig) -> RunResult:
    cfg.validate()
    from .privileges import require_bcc, require_bpf_privileges
    from .runtime.control import PAUSE_RECORDER, Control
    from .session import Session, SessionConfig

    require_bcc()  # before anything is created: a refused run leaves nothing behind
    require_bpf_privileges()
    if cfg.out.exists():
        raise RecordingError(f"{cfg.out} already exists; choose another --out or remove it")
    try:
        cfg.out.mkdir(mode=0o700, parents=True)
        (cfg.out / "runtime").mkdir()
        (cfg.out / "incidents").mkdir()
        ctl = Control(cfg.out / "runtime")  # initialised before any rank can race to create it
    except OSError as e:
        raise RecordingError(f"cannot create {cfg.out}: {e.strerror}") from None
    # Snapshots of a crashed rank are orphaned; as subreaper we get them, not init.
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    # The control block's `paused` word (an overhead measurement, `just bench
    # run`) pauses the recorder, the ranks' runtime, or both.
    session = Session(SessionConfig(out=cfg.out / "recording.duckdb", quiet=cfg.quiet,
                                    paused=lambda: ctl.paused & PAUSE_RECORDER != 0))
    status = _StatusLine(cfg.out) if sys.stderr.isatty() and not cfg.quiet else None
    window_dir = _window_dir(cfg.out)
    env = cfg.env()
    env["WATCHER_WINDOW_DIR"] = str(window_dir)
    try:
        try:
            result = session.record(list(cfg.cmd), env=env)
        finally:
            if status:
                status.stop()
        _crash_incident(cfg)
        _unfinished_incidents(cfg.out)
        incidents = ingest(cfg.out)
    finally:
        if window_dir != cfg.out / "runtime":
            shutil.rmtree(window_dir, ignore_errors=True)
    steps = _count_steps(cfg.out)
    code = result.target_exit or 0
    if not cfg.quiet:
        for inc in incidents:
            print(describe(inc), file=sys.stderr)
    _reap_orphans()
    return RunResult(cfg.out, code, incidents, steps)


def _window_dir(out: Path) -> Path:
    """Replay windows go to tmpfs (/dev/shm) when there is one: no disk writeback."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= 2 << 30:
        return Path(tempfile.mkdtemp(prefix=f"watcher-window-{out.name}-", dir=shm))
    return out / "runtime"


def describe(inc: dict) -> str:
    rep = inc.get("replay") or {}
    if inc["kind"] == "replay_check":
        w = inc.get("window") or {}
        if w.get("from_step") is None:
            return f"watcher: replay check at step {inc['detected_step']}: no snapshot to replay from"
        return (f"watcher: replay check of steps {w['from_step'] + 1}..{w['to_step']}: "
                + ("every step fingerprint and collective checksum matched the record" if rep.get("exact")
                   else f"DIFFERS from the record (first divergence {rep.get('first_divergence')})"))
    div = rep.get("first_divergence")
    where = ""
    if div:
        c = div.get("collective") or {}
        where = (f"; first divergence on rank {div['rank']} at step {div['step']}"
                 + (f", {c.get('op')} #{c.get('seq')}" if c else "") + f" ({div['where']})")
    elif rep.get("stall"):
        s = rep["stall"]
        where = f"; rank {s['rank']} entered {s['collective']['op']} #{s['collective']['seq']} at step {s['step']} {s['wait_s']} s late"
    return (f"watcher: {inc['incident_id']}: {inc['kind']} at step {inc['detected_step']} on rank "
            f"{inc['detected_rank']} -> {inc.get('classification') or 'unclassified'}"
            + (f" ({inc['transient_cause']})" if inc.get("transient_cause") else "") + where)


class _StatusLine:
    """One refreshing line on a terminal: step, ranks, incidents."""

    def __init__(self, out: Path):
        self.out = out
        self.done = threading.Event()
        self.t = threading.Thread(target=self._loop, daemon=True)
        self.t.start()

    def _loop(self) -> None:
        from .runtime.control import Control, SIZE

        ctl = None
        while not self.done.wait(1.0):
            path = self.out / "runtime" / "control"
            if ctl is None:
                if not path.exists() or path.stat().st_size < SIZE:
                    continue
                ctl = Control(self.out / "runtime")
            ranks = [ctl.latest_step(r) for r in range(64)]
            live = [s for s in ranks if s >= 0]
            n_inc = len(list((self.out / "incidents").glob("*.json")))
            if live:
                sys.stderr.write(f"\rwatcher: step {max(live)}  ranks {len(live)}  incidents {n_inc}   ")
                sys.stderr.flush()

    def stop(self) -> None:
        self.done.set()
        sys.stderr.write("\n")


# -- after the job ---------------------------------------------------------------------------

def _ranks(out: Path) -> list[dict]:
    con = duckdb.connect(str(out / "recording.duckdb"), read_only=True)
    try:
        rows = con.execute(
            "SELECT p.rank, p.pid, p.exit_code, p.exit_signal, p.end_ts FROM process p "
            "LEFT JOIN process parent ON parent.upid = p.parent_upid "
            "WHERE p.rank IS NOT NULL AND parent.rank IS NULL ORDER BY p.end_ts").fetchall()
    finally:
        con.close()
    return [dict(zip(("rank", "pid", "exit_code", "exit_signal", "end_ts"), r)) for r in rows]


def _crash_incident(cfg: RunConfig) -> dict | None:
    """The first rank to die abnormally (not stopped by Watcher, not killed by
    the launcher after a peer failed): replay it from its newest snapshot."""
    from .replay.coordinator import incident_doc, read_steps

    try:
        ranks = _ranks(cfg.out)
    except duckdb.Error:
        return None
    crashed = None
    for r in ranks:
        sig, code = r["exit_signal"], r["exit_code"]
        if sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGINT) or code in (0, STOPPED_BY_WATCHER, None) and not sig:
            continue
        crashed = r
        break
    if crashed is None:
        return None
    rank = crashed["rank"]
    steps = read_steps(cfg.out, rank)
    last = max(steps) if steps else -1
    snaps = sorted(s for s, fp in steps.items() if fp.get("snapshot"))
    # After every incident a rank opened, finished or not.
    seqs = [int(p.name.split(".")[1]) for p in (cfg.out / "runtime").glob("incident.*.json")]
    n = max(seqs + [len(list((cfg.out / "incidents").glob("inc-*.json")))]) + 1
    inc_id = f"inc-{n:04d}"
    inc_dir = cfg.out / "incidents" / inc_id
    inc_dir.mkdir(parents=True, exist_ok=True)
    how = (f"signal {signal.Signals(crashed['exit_signal']).name}" if crashed["exit_signal"]
           else f"exit code {crashed['exit_code']}")
    verdict = incident_doc(inc_id, "crash", last + 1, rank, crashed["end_ts"],
                           {"how": how, "pid": crashed["pid"], "exit_code": crashed["exit_code"],
                            "exit_signal": crashed["exit_signal"]},
                           snaps[-1] if snaps else None, last + 1)
    if snaps:
        world = max(r["rank"] for r in ranks) + 1
        reply = _crash_replay(cfg.out, rank, world, snaps[-1], last + 1, inc_dir)
        verdict["replay"] = reply
        if reply.get("crashed_again") is not None:
            again = reply["crashed_again"]
            verdict.update(classification="persistent" if again else "transient",
                           track="B" if again else "A",
                           transient_cause=None if again else "unknown")
    else:
        verdict["replay"] = {"reproduced": None, "first_divergence": None,
                             "reason": "the rank crashed before its first snapshot"}
    write_json(cfg.out / "incidents" / f"{inc_id}.json", verdict)
    return verdict


def _crash_replay(out: Path, rank: int, world: int, snap_step: int, to_step: int, inc_dir: Path,
                  wait_s: float = 120) -> dict:
    """Replay every rank from its snapshot at `snap_step` to the crash step,
    coordinated (the crashed rank's collectives need its peers' inputs); the
    snapshots are orphans by now, waiting a little for these orders."""
    from .replay.snapshot import replay_order

    reply_path = inc_dir / f"rank{rank}.crash_replay.json"
    exchange = inc_dir / "exchange"
    exchange.mkdir(exist_ok=True)
    for r in range(world):
        order = replay_order(r, to_step, inc_dir, exchange, 60, reply=inc_dir / f"rank{r}.crash_replay.json")
        write_json(out / "runtime" / f"crash_replay.rank{r}.step{snap_step}.json", order)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not reply_path.exists():
        time.sleep(0.1)
    if not reply_path.exists():
        return {"reproduced": None, "first_divergence": None,
                "reason": f"the snapshot at step {snap_step} was gone before it could be replayed"}
    with open(reply_path) as f:
        reply = json.load(f)
    others = [inc_dir / f"rank{r}.crash_replay.json" for r in range(world) if r != rank]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(o.exists() for o in others):
        time.sleep(0.1)
    shutil.rmtree(exchange, ignore_errors=True)  # the replayed inputs: large, and read by nobody now
    status = reply.get("status")
    sig = -reply["exit_code"] if reply.get("exit_code") is not None and reply["exit_code"] < 0 else None
    result = {}
    try:
        import torch

        result = torch.load(inc_dir / f"rank{rank}.result.pt", weights_only=False)
    except Exception:
        pass
    replay_status = result.get("status") if result else None
    if sig is not None or (replay_status == "exception" and reply.get("exit_code") == 1):
        again = True   # died the same way: a signal, or a Python exception at the same point
    elif replay_status == "done":
        again = False  # ran past the crash point
    else:
        again = None   # ran out of record or left no result: no answer
    return {"reproduced": again, "crashed_again": again,
            "replay_signal": signal.Signals(sig).name if sig else None,
            "replay_status": result.get("status") if result else ("killed" if sig else None),
            "replayed_steps": sorted(result.get("steps", {})) if result else None,
            "first_divergence": result.get("first_divergence") if result else None,
            "from_step": snap_step, "wait_status": status}


def _unfinished_incidents(out: Path) -> None:
    """Incidents opened by a rank whose peers never reached the halt step (a
    hang that did not resolve, a rank killed meanwhile): written without a
    replay, with the recorder's view of where each rank was blocked."""
    import glob

    from .replay.coordinator import incident_doc

    for p in sorted(glob.glob(str(out / "runtime" / "incident.*.json"))):
        with open(p) as f:
            info = json.load(f)
        final = out / "incidents" / f"{info['incident_id']}.json"
        if final.exists():
            continue
        blocked = None
        try:
            from .analysis.incidents import analyze_hang
            from .store import Recordings

            with Recordings([out / "recording.duckdb"]) as recs:
                blocked = analyze_hang(recs)
        except Exception as e:  # the analysis is a bonus; the incident is written regardless
            blocked = {"error": str(e)}
        doc = incident_doc(info["incident_id"], info["kind"], info["failing_step"], info["rank"],
                           info["detected_ts"], info.get("detail"), None, info["failing_step"],
                           info.get("unsupported")
                           or "the ranks never reached the halt step, so no window could be replayed")
        doc["recorder_view"] = blocked
        write_json(final, doc)


def _reap_orphans() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _count_steps(out: Path) -> int:
    try:
        con = duckdb.connect(str(out / "recording.duckdb"), read_only=True)
        try:
            return con.execute("SELECT coalesce(max(step) + 1, 0) FROM step").fetchone()[0]
        finally:
            con.close()
    except duckdb.Error:
        return 0


def ingest(out: Path) -> list[dict]:
    """Copy the runtime's logs, the incidents and the sandbox logs into the recording."""
    from . import schema
    from .replay.coordinator import read_colls, read_steps

    rt_dir = out / "runtime"
    ranks = sorted({int(p.name[4:].split(".")[0]) for p in rt_dir.glob("rank*.steps.jsonl")})
    step_rows, coll_rows = [], []
    for r in ranks:
        for k, fp in sorted(read_steps(out, r).items()):
            step_rows.append((r, k, fp["ts"], fp.get("dur"), fp.get("loss"), fp.get("grad_norm"),
                              _i64(fp.get("param_sum")), _i64(fp.get("batch_sum")), fp.get("rng"),
                              fp.get("n_coll"), fp.get("snapshot"), fp.get("watcher_us")))
        for (g, seq), c in sorted(read_colls(out, r).items(), key=lambda kv: kv[1]["ts"]):
            coll_rows.append((r, g, seq, c["op"], c["step"], c.get("numel"), c.get("dtype"), c.get("reduce_op"),
                              _i64(c.get("in_sum")), _i64(c.get("out_sum")), c.get("site"), c["ts"], c.get("dur")))
    incidents, inc_rows, sandbox_rows, chain_rows = [], [], [], []
    for p in sorted((out / "incidents").glob("inc-*.json")):
        with open(p) as f:
            inc = json.load(f)
        incidents.append(inc)
        rep = inc.get("replay") or {}
        div = rep.get("first_divergence") or {}
        c = div.get("collective") or {}
        inc_rows.append((inc["incident_id"], inc["kind"], inc.get("detected_step"), inc.get("detected_rank"),
                         inc.get("detected_ts"), (inc.get("window") or {}).get("from_step"),
                         (inc.get("window") or {}).get("to_step"), rep.get("reproduced"),
                         div.get("rank"), div.get("step"),
                         f"{c.get('group')}/{c.get('seq')} {c.get('op')}" if c else None, div.get("where"),
                         inc.get("classification"), inc.get("track"), inc.get("transient_cause"),
                         inc.get("recovered"), inc.get("resumed_at_step"), inc.get("steps_lost"),
                         ((inc.get("recovery") or {}).get("detect_to_resume_s")),
                         (inc.get("attribution") or {}).get("cause"), (inc.get("attribution") or {}).get("confidence"),
                         (inc.get("prescription") or {}).get("action"), (inc.get("prescription") or {}).get("applied"),
                         json.dumps(inc)))
        for i, link in enumerate(inc.get("causal_chain") or []):
            c = link.get("collective")
            chain_rows.append((inc["incident_id"], i, link.get("kind"), link.get("step"), link.get("rank"),
                               link.get("module"), link.get("op"),
                               f"{c.get('group')}/{c.get('seq')} {c.get('op')}" if c else None, link.get("evidence")))
        for log in sorted((out / "incidents" / inc["incident_id"]).glob("rank*.sandbox.jsonl")):
            rank = int(log.name[4:].split(".")[0])
            with open(log) as f:
                for line in f:
                    try:
                        e = json.loads(line)
                    except ValueError:
                        continue
                    sandbox_rows.append((inc["incident_id"], rank, e["ts"], e["pid"], e["syscall"], e.get("fd"),
                                         e["action"]))
    con = duckdb.connect(str(out / "recording.duckdb"))
    try:
        for table, rows in (("step", step_rows), ("collective_io", coll_rows), ("incident", inc_rows),
                            ("sandbox_event", sandbox_rows), ("causal_link", chain_rows)):
            con.execute(schema.TABLE_BY_NAME[table].ddl())
            insert_rows(con, table, rows)
    finally:
        con.close()
    os.chmod(out / "recording.duckdb", 0o600)
    return incidents


def _i64(v):
    """Checksums are 63-bit; keep them as-is (BIGINT)."""
    return v
