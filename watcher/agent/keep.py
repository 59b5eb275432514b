"""Keeping a job's part of the agent's ring, and the fleet's Parquet tree.

The agent records every job on its node into one in-memory ring.  Keeping a
job writes the rows of its processes (and what was sent to them) into a
recording of its own: a DuckDB file like any other, read by `watcher
analyze`, `watcher sql` and `watcher report`.  It is written under a
temporary name and renamed when complete, so an agent killed mid-write never
leaves a file that looks like a recording.

`export_parquet` adds a kept recording to a Hive-partitioned tree,
TREE/<table>/node=<node>/job=<job>/rank=<rank>/*.parquet, that any engine
reads in place (DuckDB here, Spark or Trino across machines).  Rows of a
process that is not a rank (the launcher, a DataLoader worker's parent
rows) go to rank=-1.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import duckdb

from .. import schema
from ..store import PARQUET_MARKER, give_to_invoking_user

# How a table's rows are chosen for one job, by the columns it has.
_THREAD_TARGET = "target_utid IN (SELECT utid FROM {db}.thread WHERE upid IN (SELECT upid FROM _keep_upids))"


def _row_filter(table: schema.Table, db: str) -> str:
    cols = set(table.column_names)
    if table.name == "signal":
        # A signal from outside the job (kill -9 from a shell) has no upid in
        # the job: it is kept by its target.
        return f"upid IN (SELECT upid FROM _keep_upids) OR {_THREAD_TARGET.format(db=db)}"
    if "upid" in cols:
        return "upid IN (SELECT upid FROM _keep_upids)"
    return "true"


def keep_job(con: duckdb.DuckDBPyConnection, out: Path, upids: list[int], meta: dict,
             before_publish=None) -> Path:
    """Write the rows of processes `upids` from the live database behind
    `con` to the recording `out`, with `meta` over the live meta.
    `before_publish(path)` runs on the complete file before it takes its
    name (the Parquet export: a kept recording in place means everything
    about it is done)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    for p in (tmp, Path(str(tmp) + ".wal")):
        p.unlink(missing_ok=True)
    db = con.execute("SELECT current_database()").fetchone()[0]
    con.execute("CREATE OR REPLACE TEMP TABLE _keep_upids (upid INTEGER)")
    if upids:
        con.execute("INSERT INTO _keep_upids SELECT unnest(?)", [list(upids)])
    con.execute(f"ATTACH '{tmp}' AS _kept")
    try:
        present = {r[0] for r in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = ?", [db]).fetchall()}
        for t in schema.TABLES:
            con.execute(t.ddl().replace(f"CREATE TABLE IF NOT EXISTS {t.name}", f"CREATE TABLE _kept.{t.name}", 1))
            if t.name in present and t.name != "meta":
                con.execute(f"INSERT INTO _kept.{t.name} SELECT * FROM {db}.main.{t.name} "
                            f"WHERE {_row_filter(t, db)}")
        facts = dict(con.execute(f"SELECT key, value FROM {db}.main.meta").fetchall())
        facts.update({k: None if v is None else str(v) for k, v in meta.items()})
        rows = [(k, v) for k, v in facts.items()]
        con.executemany("INSERT INTO _kept.meta VALUES (?, ?)", rows)
    finally:
        con.execute("DETACH _kept")
        con.execute("DROP TABLE IF EXISTS _keep_upids")
    if before_publish is not None:
        before_publish(tmp)
    os.replace(tmp, out)
    give_to_invoking_user(out)
    return out


_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_name(text: str) -> str:
    """A Hive partition value / file name from any text."""
    return _SAFE.sub("_", text).strip("_") or "unnamed"


def export_parquet(rec: Path, tree: Path, node: str, job: str) -> int:
    """Add recording `rec` to the Parquet tree; returns the rows written.

    Files are written beside the tree and each renamed into it when
    complete: a reader of the tree (another node's `watcher sql`, Spark)
    never opens a half-written one."""
    node, job = safe_name(node), safe_name(job)
    tree.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{tree.name}.staging-", dir=tree.parent))
    try:
        total = _export(rec, staging, node, job)
        for f in sorted(staging.rglob("*.parquet")):
            dest = tree / f.relative_to(staging)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(f, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    marker = tree / PARQUET_MARKER
    if not marker.exists():
        marker.write_text("Watcher recordings as Hive-partitioned Parquet: <table>/node=/job=/rank=/\n")
    return total


def _export(rec: Path, tree: Path, node: str, job: str) -> int:
    con = duckdb.connect(str(rec), read_only=True, config={"threads": 1})
    total = 0
    try:
        present = {r[0]: {c for c in r[1]} for r in con.execute(
            "SELECT table_name, list(column_name) FROM duckdb_columns() "
            "WHERE schema_name = 'main' GROUP BY table_name").fetchall()}
        for t in schema.TABLES:
            cols = present.get(t.name)
            if not cols:
                continue
            n = con.execute(f"SELECT count(*) FROM {t.name}").fetchone()[0]
            if not n:
                continue
            if "rank" in cols:
                sel = f"SELECT * EXCLUDE (rank), coalesce(rank, -1) AS rank FROM {t.name}"
            elif "upid" in cols and "process" in present:
                sel = (f"SELECT t.*, coalesce(p.rank, -1) AS rank FROM {t.name} t "
                       f"LEFT JOIN process p ON p.upid = t.upid")
            else:
                sel = f"SELECT *, -1 AS rank FROM {t.name}"
            dest = tree / t.name
            dest.mkdir(parents=True, exist_ok=True)
            con.execute(f"COPY (SELECT *, '{node}' AS node, '{job}' AS job FROM ({sel})) TO '{dest}' "
                        "(FORMAT PARQUET, PARTITION_BY (node, job, rank), OVERWRITE_OR_IGNORE, "
                        "FILENAME_PATTERN 'part_{uuid}')")
            total += n
    finally:
        con.close()
    return total

