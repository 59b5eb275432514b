# Watcher tasks. `just --list` shows them.

venv := ".venv/bin"

setup:
    bash scripts/setup

test: setup
    {{venv}}/python -m pytest -q tests

demo: setup
    {{venv}}/watcher demo

# `just bench recorder|uprobes|run|recover|diagnose|scale|sandbox|audit|agent`: each prints a table and writes bench-results/<what>.json
bench what="recorder": setup
    {{venv}}/python scripts/bench_{{what}}.py

docs:
    {{venv}}/watcher schema > docs/schema.md
