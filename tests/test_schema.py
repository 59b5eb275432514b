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
