"""Recording files: one DuckDB database per recording.

Writing: every flush is one transaction, so a collector killed at any moment
leaves a database that opens with everything up to its last flush (DuckDB
replays its WAL on open).  Files are created with mode 0600.

Reading: `open_recordings` attaches one or more recordings read-only into one
in-memory database and exposes each table as a view over the union, with
surrogate ids shifted apart so joins never mix processes of two recordings.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import tempfile
from pathlib import Path

import duckdb
import numpy as np

from . import schema
from .errors import QueryError, RecordingError
from .syscall_names import SYSCALL_NAMES

FUTEX_CMD_NAMES = {
    0: "FUTEX_WAIT", 1: "FUTEX_WAKE", 2: "FUTEX_FD", 3: "FUTEX_REQUEUE", 4: "FUTEX_CMP_REQUEUE",
    5: "FUTEX_WAKE_OP", 6: "FUTEX_LOCK_PI", 7: "FUTEX_UNLOCK_PI", 8: "FUTEX_TRYLOCK_PI",
    9: "FUTEX_WAIT_BITSET", 10: "FUTEX_WAKE_BITSET", 11: "FUTEX_WAIT_REQUEUE_PI",
    12: "FUTEX_CMP_REQUEUE_PI", 13: "FUTEX_LOCK_PI2",
}

# Ids of two recordings queried together are shifted by this much apiece.
ID_STRIDE = 1 << 24
# A directory holding this file is a Parquet tree of recordings (watcher/agent/keep.py).
PARQUET_MARKER = "WATCHER_PARQUET"


def _signal_names() -> dict[int, str]:
    names = {int(s): s.name for s in signal.Signals if not s.name.startswith("SIG_")}
    return names


class RecordingWriter:
    def __init__(self, path: str | os.PathLike, in_memory: bool = False):
        self.path = Path(path)
        self.in_memory = in_memory
        if not in_memory:
            self._create_file(self.path)
        # One DuckDB thread: on a node whose cores all belong to the ranks,
        # every parallel worker the writer spawns is stolen from training.
        self.con = duckdb.connect(":memory:" if in_memory else str(self.path),
                                  config={"threads": 1, "memory_limit": "1GB"})
        for stmt in schema.create_statements():
            self.con.execute(stmt)
        for stmt in schema.view_statements():
            self.con.execute(stmt)
        # Lookup tables live in the temp schema: joined at insert time, never
        # stored.  Names are joined in SQL, not looked up in Python: DuckDB
        # joins with the GIL released, so the drain thread keeps emptying the
        # rings (an object array of names held it for every row: storms dropped).
        self.con.execute("CREATE TEMP TABLE _syscall_name(nr INTEGER, name VARCHAR)")
        self.con.executemany("INSERT INTO _syscall_name VALUES (?, ?)", list(SYSCALL_NAMES.items()))
        self.con.execute("CREATE TEMP TABLE _futex_cmd(cmd INTEGER, name VARCHAR)")
        self.con.executemany("INSERT INTO _futex_cmd VALUES (?, ?)", list(FUTEX_CMD_NAMES.items()))
        self.con.execute("CREATE TEMP TABLE _signal_name(signo INTEGER, name VARCHAR)")
        self.con.executemany("INSERT INTO _signal_name VALUES (?, ?)", list(_signal_names().items()))
        self.next_futex_id = 0
        if not in_memory:
            self._private()

    @staticmethod
    def _create_file(path: Path) -> None:
        if path.exists():
            raise RecordingError(f"{path} already exists; choose another --out or remove it")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except OSError as e:
            raise RecordingError(f"cannot write {path}: {e.strerror}") from None
        os.close(fd)
        os.unlink(path)  # DuckDB creates it; we only proved it can be written

    # -- meta ---------------------------------------------------------------
    def set_meta(self, **facts) -> None:
        if not facts:
            return
        keys = list(facts)
        self.con.execute(f"DELETE FROM meta WHERE key IN ({', '.join('?' * len(keys))})", keys)
        values = []
        for k in keys:
            values += [k, None if facts[k] is None else str(facts[k])]
        self.con.execute(f"INSERT INTO meta VALUES {', '.join(['(?, ?)'] * len(keys))}", values)

    # -- batched appends -----------------------------------------------------
    def begin(self) -> None:
        self.con.execute("BEGIN TRANSACTION")

    def commit(self) -> None:
        self.con.execute("COMMIT")
        self._private()

    def _private(self) -> None:
        # Recordings hold arguments and paths of the traced job: owner-only.
        for p in (self.path, Path(str(self.path) + ".wal")):
            try:
                os.chmod(p, 0o600)
            except OSError:
                pass

    def _insert(self, table: str, batch: dict[str, np.ndarray], select: str) -> None:
        # `_batch` is found by DuckDB's replacement scan (a local of the frame
        # that calls execute): register/unregister cost ~1.3 ms a statement,
        # about a fifth of a flush.
        _batch = batch  # noqa: F841 - read by name from the SQL
        self.con.execute(f"INSERT INTO {table} {select}")

    def append_syscalls(self, ts, dur, utid, upid, nr, ret, args, cpu) -> None:
        if len(ts) == 0:
            return
        batch = {"ts": ts.astype(np.int64), "dur": dur.astype(np.int64), "utid": utid,
                 "upid": upid, "nr": nr.astype(np.int32), "ret": ret, "cpu": cpu.astype(np.int32)}
        for i in range(6):
            batch[f"arg{i}"] = np.ascontiguousarray(args[:, i])
        self._insert("syscall", batch,
                     "SELECT b.ts, b.dur, b.utid, b.upid, b.nr, "
                     "coalesce(n.name, 'syscall_' || b.nr), b.ret, b.arg0, b.arg1, b.arg2, "
                     "b.arg3, b.arg4, b.arg5, b.cpu FROM _batch b LEFT JOIN _syscall_name n USING (nr)")

    def append_futex(self, ev: np.ndarray, utid, upid, waker_utid) -> None:
        n = len(ev)
        if n == 0:
            return
        ids = np.arange(self.next_futex_id, self.next_futex_id + n, dtype=np.int64)
        self.next_futex_id += n
        batch = {"futex_id": ids, "ts": ev["ts"].astype(np.int64), "dur": ev["dur"].astype(np.int64),
                 "utid": utid, "upid": upid, "kind": ev["kind"].astype(np.int32),
                 "op": ev["op"].astype(np.int32), "uaddr": ev["uaddr"],
                 "val": ev["val"].astype(np.int64), "timeout_ns": ev["timeout_ns"],
                 "ret": ev["ret"], "waker_utid": waker_utid, "wake_ts": ev["wake_ts"].astype(np.int64)}
        self._insert("futex", batch,
                     "SELECT b.futex_id, b.ts, b.dur, b.utid, b.upid, "
                     "CASE b.kind WHEN 1 THEN 'wait' ELSE 'wake' END, b.op, "
                     "coalesce(c.name, 'FUTEX_' || (b.op & 127)), b.uaddr, b.val, "
                     "CASE WHEN b.timeout_ns < 0 THEN NULL ELSE b.timeout_ns END, b.ret, "
                     "CASE WHEN b.waker_utid < 0 THEN NULL ELSE b.waker_utid END, "
                     "CASE WHEN b.waker_utid < 0 THEN NULL ELSE b.wake_ts END "
                     "FROM _batch b LEFT JOIN _futex_cmd c ON c.cmd = (b.op & 127)")

    def append_signals(self, ev: np.ndarray, utid, upid, target_utid) -> None:
        if len(ev) == 0:
            return
        batch = {"ts": ev["ts"].astype(np.int64), "kind": ev["kind"].astype(np.int32),
                 "signo": ev["sig"].astype(np.int32), "utid": utid, "upid": upid,
                 "sender_pid": ev["pid"].astype(np.int32), "target_tid": ev["target_tid"].astype(np.int32),
                 "target_utid": target_utid, "code": ev["code"].astype(np.int32),
                 "result": ev["result"].astype(np.int32)}
        self._insert("signal", batch,
                     "SELECT b.ts, CASE b.kind WHEN 1 THEN 'generate' ELSE 'deliver' END, b.signo, "
                     "coalesce(s.name, 'SIG' || b.signo), CASE WHEN b.utid < 0 THEN NULL ELSE b.utid END, "
                     "CASE WHEN b.upid < 0 THEN NULL ELSE b.upid END, b.sender_pid, b.target_tid, "
                     "CASE WHEN b.target_utid < 0 THEN NULL ELSE b.target_utid END, b.code, "
                     "CASE WHEN b.kind = 1 THEN b.result ELSE NULL END "
                     "FROM _batch b LEFT JOIN _signal_name s USING (signo)")

    def append_file_opens(self, ev: np.ndarray, utid, upid) -> None:
        if len(ev) == 0:
            return
        batch = {"ts": ev["ts"].astype(np.int64), "dur": ev["dur"].astype(np.int64), "utid": utid, "upid": upid,
                 "path": np.array([p.decode("utf-8", "replace") for p in ev["path"]], dtype=object),
                 "flags": ev["flags"].astype(np.int32), "ret": ev["ret"].astype(np.int64),
                 "nr": ev["nr"].astype(np.int32)}
        # O_ACCMODE is 3; O_CREAT 0o100.
        self._insert("file_open", batch,
                     "SELECT b.ts, b.dur, b.utid, b.upid, b.path, b.flags, "
                     "(b.flags & 3) != 0 OR (b.flags & 64) != 0, b.ret, "
                     "CASE b.nr WHEN 2 THEN 'open' WHEN 257 THEN 'openat' WHEN 437 THEN 'openat2' "
                     "ELSE 'creat' END FROM _batch b")

    def append_rows(self, table: str, rows: list[tuple]) -> None:
        """Append low-rate rows given as tuples in schema column order."""
        insert_rows(self.con, table, rows)

    def replace_rows(self, table: str, rows: list[tuple]) -> None:
        """Rewrite a small mutable table (process, thread, stats) in full."""
        self.con.execute(f"DELETE FROM {table}")
        self.append_rows(table, rows)

    def replace_syscall_stats(self, stats: np.ndarray, utid, upid) -> None:
        self.con.execute("DELETE FROM syscall_stat")
        if len(stats) == 0:
            return
        batch = {"utid": utid, "upid": upid, "nr": stats["nr"].astype(np.int32),
                 "count": stats["count"].astype(np.int64), "dur": stats["dur"].astype(np.int64),
                 "logged": stats["logged"].astype(np.int64), "idle": stats["idle"].astype(np.int64)}
        self._insert("syscall_stat", batch,
                     "SELECT b.utid, b.upid, b.nr, coalesce(n.name, 'syscall_' || b.nr), b.count, "
                     "b.dur, b.logged, b.idle FROM _batch b LEFT JOIN _syscall_name n USING (nr)")

    def used_bytes(self) -> int:
        """Space the data takes (blocks in use plus the WAL): DuckDB reuses the
        blocks a DELETE frees but does not shrink the file.  In memory (ring
        mode): the bytes the tables hold, which a prune and checkpoint free."""
        if self.in_memory:
            try:
                return int(self.con.execute(
                    "SELECT coalesce(sum(memory_usage_bytes), 0) FROM duckdb_memory() "
                    "WHERE tag = 'IN_MEMORY_TABLE'").fetchone()[0])
            except duckdb.Error:
                return 0
        try:
            total, free, block = self.con.execute(
                "SELECT total_blocks, free_blocks, block_size FROM pragma_database_size()").fetchone()
            used = (total - free) * block
        except duckdb.Error:
            used = 0
        wal = Path(str(self.path) + ".wal")
        return used + (wal.stat().st_size if wal.exists() else 0)

    def size_bytes(self) -> int:
        total = 0
        for p in (self.path, Path(str(self.path) + ".wal")):
            try:
                total += p.stat().st_size
            except OSError:
                pass
        return total

    def close(self) -> None:
        try:
            self.con.execute("CHECKPOINT")
        finally:
            self.con.close()
        give_to_invoking_user(self.path)


def give_to_invoking_user(path: Path) -> None:
    """Owner-only, and owned by the user who ran sudo, so they can query it."""
    try:
        os.chmod(path, 0o600)
        uid, gid = os.environ.get("SUDO_UID"), os.environ.get("SUDO_GID")
        if os.geteuid() == 0 and uid and gid:
            os.chown(path, int(uid), int(gid))
    except (OSError, ValueError):
        pass


# Column types handed to DuckDB as typed arrays.  INTEGER goes as int64 and
# is cast on insert: a value out of range fails the statement instead of
# wrapping in numpy.
_NUMPY_TYPE = {"BIGINT": np.int64, "INTEGER": np.int64, "UBIGINT": np.uint64, "DOUBLE": np.float64,
               "BOOLEAN": np.bool_}


def insert_rows(con: duckdb.DuckDBPyConnection, table: str, rows: list[tuple]) -> None:
    """Insert rows given as tuples in schema column order, in one statement.

    executemany runs one statement per row (~0.8 ms each here: a long run's
    step table took minutes); columns handed to DuckDB's replacement scan
    take milliseconds for tens of thousands of rows."""
    if not rows:
        return
    t = schema.TABLE_BY_NAME[table]
    _rows, select = _as_frame({c.name: [r[i] for r in rows] for i, c in enumerate(t.columns)},  # noqa: F841
                              {c.name: c.type for c in t.columns})
    con.execute(f"INSERT INTO {table} SELECT {', '.join(select)} FROM _rows")


# -- the tables `watcher run` adds after the job (watcher/run.py) --------------------------------

def write_run_tables(path: Path, tables: dict[str, list[tuple]]) -> None:
    """Create the runtime's tables (step, collective_io, incident, ...) in a
    recording and insert their rows, one statement per table."""
    con = duckdb.connect(str(path))
    try:
        for table, rows in tables.items():
            con.execute(schema.TABLE_BY_NAME[table].ddl())
            insert_rows(con, table, rows)
    finally:
        con.close()
    os.chmod(path, 0o600)


def incident_row(inc: dict) -> tuple:
    """An incident document (watcher/incident.py) as a row of the `incident` table."""
    rep = inc.get("replay") or {}
    div = rep.get("first_divergence") or {}
    c = div.get("collective") or {}
    window = inc.get("window") or {}
    attribution, prescription = inc.get("attribution") or {}, inc.get("prescription") or {}
    return (inc["incident_id"], inc["kind"], inc.get("detected_step"), inc.get("detected_rank"),
            inc.get("detected_ts"), window.get("from_step"), window.get("to_step"), rep.get("reproduced"),
            div.get("rank"), div.get("step"),
            f"{c.get('group')}/{c.get('seq')} {c.get('op')}" if c else None, div.get("where"),
            inc.get("classification"), inc.get("track"), inc.get("transient_cause"),
            inc.get("recovered"), inc.get("resumed_at_step"), inc.get("steps_lost"),
            (inc.get("recovery") or {}).get("detect_to_resume_s"),
            attribution.get("cause"), attribution.get("confidence"),
            prescription.get("action"), prescription.get("applied"), json.dumps(inc))


def causal_link_rows(inc: dict) -> list[tuple]:
    """An incident's causal chain as rows of the `causal_link` table, root cause first."""
    rows = []
    for i, link in enumerate(inc.get("causal_chain") or []):
        c = link.get("collective")
        rows.append((inc["incident_id"], i, link.get("kind"), link.get("step"), link.get("rank"),
                     link.get("module"), link.get("op"),
                     f"{c.get('group')}/{c.get('seq')} {c.get('op')}" if c else None, link.get("evidence")))
    return rows


def rank_processes(path: Path, took_over: dict[int, int] | None = None) -> list[dict]:
    """The ranks' own processes in a recording, in the order they ended: not
    their forks or the programs they run.  `took_over` ({pid: rank}) adds the
    snapshots that took a rank over after a rescue, as the ranks named them
    (the recording labels such a fork only once it has seen it renamed)."""
    con = duckdb.connect(str(path), read_only=True)
    try:
        rows = con.execute(
            "SELECT p.rank, p.pid, p.exit_code, p.exit_signal, p.end_ts FROM process p "
            "LEFT JOIN process parent ON parent.upid = p.parent_upid "
            "WHERE p.rank IS NOT NULL AND parent.rank IS NULL ORDER BY p.end_ts").fetchall()
        seen = {r[1] for r in rows}
        for pid, rank in (took_over or {}).items():
            if pid in seen:
                continue
            row = con.execute("SELECT pid, exit_code, exit_signal, end_ts FROM process WHERE pid = ? "
                              "ORDER BY upid DESC LIMIT 1", [pid]).fetchone()
            if row is not None:
                rows.append((rank, *row))
    finally:
        con.close()
    rows.sort(key=lambda r: (r[4] is None, r[4] or 0))
    return [dict(zip(("rank", "pid", "exit_code", "exit_signal", "end_ts"), r)) for r in rows]


def count_steps(path: Path) -> int:
    """Steps in a recording's `step` table; 0 when there is none."""
    try:
        con = duckdb.connect(str(path), read_only=True)
        try:
            return con.execute("SELECT coalesce(max(step) + 1, 0) FROM step").fetchone()[0]
        finally:
            con.close()
    except duckdb.Error:
        return 0


def _as_frame(columns: dict[str, list], types: dict[str, str]) -> tuple[dict, list[str]]:
    """A dict of arrays DuckDB can scan, and the select list that reads it
    back in column order.

    Every numeric or boolean column becomes a typed array, NULLs as a flag
    column beside it: DuckDB types an object array from a sample of its
    rows, so one long step's duration past the sample (a BIGINT among values
    that fit INTEGER) would fail the insert, and a float among sampled ints
    would be rounded.  DuckDB also reads a NaN in an array as NULL, so a
    float column holding NaN (a non-finite loss: the very thing a recording
    must keep) carries a second flag that puts it back.  Text stays an
    object array of str and None."""
    out, select = {}, []
    for k, v in columns.items():
        col_type = types.get(k, "")
        np_type = _NUMPY_TYPE.get(col_type)
        if np_type is None:
            out[k] = np.array([x if x is None or isinstance(x, str) else str(x) for x in v], dtype=object)
            select.append(k if col_type == "VARCHAR" else f"CAST({k} AS {col_type})")
            continue
        null = [x is None for x in v]
        try:
            out[k] = np.array([0 if x is None else x for x in v], dtype=np_type)
        except (OverflowError, TypeError, ValueError):
            # Not representable as given (a negative UBIGINT): exact text, cast by DuckDB.
            out[k] = np.array([None if x is None else repr(x) for x in v], dtype=object)
            select.append(f"CAST({k} AS {col_type})")
            continue
        cases = []
        if any(null):
            out[f"_null_{k}"] = np.array(null)
            cases.append(f"WHEN _null_{k} THEN NULL")
        if np_type is np.float64:
            nan = np.isnan(out[k])
            if nan.any():
                out[f"_nan_{k}"] = nan
                cases.append(f"WHEN _nan_{k} THEN 'NaN'::DOUBLE")
        expr = k if col_type in ("BIGINT", "UBIGINT", "DOUBLE", "BOOLEAN") else f"CAST({k} AS {col_type})"
        select.append(f"CASE {' '.join(cases)} ELSE {expr} END" if cases else expr)
    return out, select


# ---------------------------------------------------------------------------
# Reading


def read_meta(con: duckdb.DuckDBPyConnection, catalog: str | None = None) -> dict[str, str]:
    prefix = f"{catalog}." if catalog else ""
    return dict(con.execute(f"SELECT key, value FROM {prefix}meta").fetchall())


HEADER_SIZE = 4096


def expected_size(head: bytes) -> int | None:
    """Bytes a DuckDB file must have, from the newer of its two database headers
    (checksum, iteration, meta block, free list, block count, block size...)."""
    best = None
    for off in (HEADER_SIZE, 2 * HEADER_SIZE):
        if len(head) < off + 48:
            return None
        _, iteration, _, _, blocks, block_size = struct.unpack_from("<QQqqQQ", head, off)
        if best is None or iteration > best[0]:
            best = (iteration, blocks, block_size)
    _, blocks, block_size = best
    if block_size == 0 or block_size > 1 << 30 or blocks > 1 << 40:
        return None
    return 3 * HEADER_SIZE + blocks * block_size


def _check_file(path: Path) -> None:
    if not path.exists():
        raise RecordingError(f"{path}: no such recording")
    try:
        with open(path, "rb") as f:
            head = f.read(3 * HEADER_SIZE)
    except OSError as e:
        raise RecordingError(f"{path}: cannot read ({e.strerror}); recordings are owner-only: "
                             "use sudo, or chown the file") from None
    if len(head) < 12 or head[8:12] != b"DUCK":
        raise RecordingError(f"{path}: not a Watcher recording (corrupt or truncated file)")
    want = expected_size(head)
    if want is None:
        raise RecordingError(f"{path}: corrupt recording (unreadable database header)")
    have = path.stat().st_size
    if have < want:
        raise RecordingError(f"{path}: truncated recording ({have:,} of {want:,} bytes)")


def _attachable(path: Path, tmpdir: Path) -> Path:
    """A path DuckDB can attach read-only.  A recording still being written
    (locked, or with a WAL not yet checkpointed) is copied first, so queries
    see everything flushed so far without disturbing the writer."""
    wal = Path(str(path) + ".wal")
    if not wal.exists():
        return path
    copy = tmpdir / path.name
    try:
        shutil.copyfile(path, copy)
        shutil.copyfile(wal, Path(str(copy) + ".wal"))
    except OSError as e:
        raise RecordingError(f"{path}: cannot copy the live recording to {tmpdir}: {e.strerror}") from None
    # Replay the WAL once, in the copy.
    try:
        duckdb.connect(str(copy)).close()
    except duckdb.Error as e:
        raise RecordingError(f"{path}: corrupt or truncated recording ({_one_line(e)})") from None
    return copy


def _one_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def expand(paths: list[str | os.PathLike]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(p.glob("*.duckdb"))
        else:
            out.append(p)
    return out


class Recordings:
    """One or more recordings attached into one in-memory database."""

    def __init__(self, paths: list[str | os.PathLike]):
        trees = [Path(p) for p in paths if Path(p, PARQUET_MARKER).is_file()]
        if trees:
            if len(trees) != len(paths):
                raise RecordingError("a Parquet tree is queried on its own, not with other recordings")
            self._open_trees(trees)
            return
        self.paths = expand(paths)
        if not self.paths:
            raise RecordingError("no recording given")
        self._tmp = Path(tempfile.mkdtemp(prefix="watcher-read-"))
        self.con = duckdb.connect(":memory:")
        self.metas: list[dict[str, str]] = []
        try:
            for i, path in enumerate(self.paths):
                _check_file(path)
                (self._tmp / str(i)).mkdir()
                src = _attachable(path, self._tmp / str(i))
                try:
                    self.con.execute(f"ATTACH '{src}' AS rec{i} (READ_ONLY)")
                    meta = read_meta(self.con, f"rec{i}")
                except duckdb.Error as e:
                    raise RecordingError(f"{path}: corrupt or truncated recording ({_one_line(e)})") from None
                version = meta.get("schema_version")
                if version is None or not version.isdigit():
                    raise RecordingError(f"{path}: recording has no schema version")
                if int(version) > schema.SCHEMA_VERSION:
                    raise RecordingError(
                        f"{path}: unknown schema version {version} (this watcher reads up to "
                        f"{schema.SCHEMA_VERSION}); upgrade watcher")
                self.metas.append(meta)
            self._union_views()
        except Exception:
            self.close()
            raise

    def _union_views(self) -> None:
        n = len(self.paths)
        # Recordings written before a table or column existed read as NULLs there.
        present = {}
        for db, table, col in self.con.execute(
                "SELECT database_name, table_name, column_name FROM duckdb_columns() WHERE database_name LIKE 'rec%'"
        ).fetchall():
            present.setdefault((db, table), set()).add(col)
        for t in schema.TABLES:
            parts = []
            for i in range(n):
                have = present.get((f"rec{i}", t.name))
                cols = []
                for c in t.columns:
                    if have is None or c.name not in have:
                        cols.append(f"CAST(NULL AS {c.type}) AS {c.name}")
                    elif c.surrogate and n > 1:
                        cols.append(f"{c.name} + {i * ID_STRIDE} AS {c.name}")
                    else:
                        cols.append(c.name)
                if n > 1:
                    cols.append(f"{i} AS recording")
                parts.append(f"SELECT {', '.join(cols)} FROM rec{i}.{t.name}" if have is not None
                             else f"SELECT {', '.join(cols)} WHERE false")
            self.con.execute(f"CREATE TEMP VIEW {t.name} AS " + " UNION ALL ".join(parts))
        for v in schema.VIEWS:
            self.con.execute(f"CREATE TEMP VIEW {v.name} AS {v.sql}")

    def _open_trees(self, trees: list[Path]) -> None:
        """Fleet SQL: the agents' Parquet trees (watcher/agent/keep.py), read in
        place.  Each table gets the partition columns node, job and rank;
        surrogate ids (upid, utid) are per recording, so joins across jobs
        also match on node and job."""
        self.paths, self.metas = trees, []
        self._tmp = Path(tempfile.mkdtemp(prefix="watcher-read-"))
        self.con = duckdb.connect(":memory:")
        for t in schema.TABLES:
            globs = [str(tree / t.name / "**" / "*.parquet") for tree in trees
                     if any((tree / t.name).glob("node=*"))]
            extra = [c for c in ("node", "job", "rank") if c not in t.column_names]
            if globs:
                self.con.execute(f"CREATE TEMP VIEW {t.name} AS SELECT * FROM read_parquet({globs!r}, "
                                 "hive_partitioning = true, union_by_name = true, "
                                 "hive_types = {'node': VARCHAR, 'job': VARCHAR, 'rank': INTEGER})")
            else:
                cols = [f"CAST(NULL AS {c.type}) AS {c.name}" for c in t.columns]
                cols += [f"CAST(NULL AS {'INTEGER' if c == 'rank' else 'VARCHAR'}) AS {c}" for c in extra]
                self.con.execute(f"CREATE TEMP VIEW {t.name} AS SELECT {', '.join(cols)} WHERE false")

    def query(self, sql: str):
        try:
            cur = self.con.execute(sql)
            cols = [d[0] for d in cur.description] if cur.description else []
            return cols, cur.fetchall()
        except duckdb.Error as e:
            raise QueryError(f"SQL error: {_one_line(e)}") from None

    def close(self) -> None:
        try:
            self.con.close()
        finally:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
