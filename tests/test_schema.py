"""The schema is declared once: every column documented, docs generated from it."""

import duckdb

from watcher import schema

from .conftest import ROOT


def test_every_table_and_column_is_documented():
    assert {t.name for t in schema.TABLES} >= {"meta", "process", "thread", "syscall", "futex",
                                               "signal", "syscall_stat", "ring_drop"}
    for t in schema.TABLES:
        assert t.doc.strip(), t.name
        assert t.name == t.name.lower(), t.name
        for c in t.columns:
            assert c.doc.strip(), f"{t.name}.{c.name}"


def test_every_view_column_is_documented_and_exists():
    con = duckdb.connect(":memory:")
    for stmt in schema.create_statements() + schema.view_statements():
        con.execute(stmt)
    assert {v.name for v in schema.VIEWS} == {"blocked_thread", "top_syscall", "thread_timeline",
                                              "process_tree", "futex_handoff", "cuda_call", "nccl_call"}
    for v in schema.VIEWS:
        actual = [d[0] for d in con.execute(f"SELECT * FROM {v.name} LIMIT 0").description]
        assert actual == list(v.columns), v.name
        assert all(doc for doc in v.columns.values()), v.name
        assert v.doc, v.name


def test_generated_docs_are_current():
    assert (ROOT / "docs" / "schema.md").read_text() == schema.markdown(), \
        "regenerate with: watcher schema > docs/schema.md"


def test_ts_and_dur_are_integer_nanoseconds():
    for t in schema.TABLES:
        for c in t.columns:
            if c.name in ("ts", "dur") or c.name.endswith("_ts"):
                assert c.type == "BIGINT", f"{t.name}.{c.name}"


def test_rows_go_in_whole_with_nan_infinity_null_and_63_bit_checksums():
    # `watcher run` ingests every step of a long run in one statement per
    # table.  DuckDB reads a NaN handed over in an array as NULL (a non-finite
    # loss is exactly what the step table must keep), and types a column it
    # is given as objects from a sample of rows: the one long step far past
    # the sample, or the one fractional value among integers, must still go
    # in exactly.
    import math

    from watcher.store import insert_rows

    con = duckdb.connect(":memory:")
    con.execute(schema.TABLE_BY_NAME["step"].ddl())
    rows = []
    for k in range(20_000):
        loss = math.nan if k == 7 else -math.inf if k == 8 else math.inf if k == 9 else None if k == 10 else k / 3
        dur = None if k == 0 else 3_000_000_000 if k == 13_001 else 19_000_000  # a 3-s step: past INTEGER
        norm = 1.7 if k == 15_003 else None if k == 15_004 else k
        rows.append((k % 2, k, 10**12 + k, dur, loss, norm,
                     (1 << 63) - 1 - k, None if k % 5 else k * 7, k ^ 0x5A5A, 1, k % 512 == 0, k % 900))
    insert_rows(con, "step", rows)
    got = con.execute("SELECT * FROM step ORDER BY step").fetchall()
    assert len(got) == len(rows)
    for want, have in zip(rows, got):
        for a, b in zip(want, have):
            assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), (want, have)
    [(nan, inf, null)] = con.execute("SELECT count(*) FILTER (WHERE isnan(loss)), "
                                     "count(*) FILTER (WHERE isinf(loss)), count(*) FILTER (WHERE loss IS NULL) "
                                     "FROM step").fetchall()
    assert (nan, inf, null) == (1, 2, 1)
    import pytest

    with pytest.raises(duckdb.Error):  # an INTEGER out of range fails the insert, it does not wrap
        insert_rows(con, "step", [(0, 1 << 40, 0, None, None, None, None, None, None, None, None, None)])
