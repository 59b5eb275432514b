"""The project's promises about itself: README commands, CI, CLI help."""

import subprocess
import sys

from .conftest import ROOT, watcher


def test_readme_opens_with_setup_and_test_commands_and_ci_runs_the_test_one():
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1: lines.index("```")]
    assert len(block) == 2
    assert block[0].startswith("bash scripts/setup && ") and "watcher demo" in block[0]
    assert block[1].startswith("bash scripts/setup && ") and "pytest" in block[1]
    assert block[1] in (ROOT / ".ci" / "run").read_text()


def test_every_command_has_help():
    top = watcher("--help", check=True).stdout
    for cmd in ("attach", "record", "sql", "info", "check", "schema", "demo"):
        assert cmd in top
        out = watcher(cmd, "--help", check=True).stdout
        assert "Usage:" in out and len(out.splitlines()) > 3, cmd


def test_import_names_live_under_watcher():
    code = ("import watcher.bpf, watcher.uprobes, watcher.replay, watcher.analysis, sys; "
            "assert 'bpf' not in sys.modules and 'replay' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")
