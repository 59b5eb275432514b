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


def test_ci_turns_every_would_be_skip_into_a_failure(tmp_path):
    """With WATCHER_TESTS_NO_SKIP=1 (.ci/run sets it) a test that would skip
    (a missing privilege or tool) fails with its reason; without it, it skips."""
    import os
    import shutil

    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", suite / "conftest.py")
    (suite / "__init__.py").write_text("")
    (suite / "test_x.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.skipif(True, reason='no frobnicator here')\n"
        "def test_needs_a_frobnicator():\n    pass\n\n"
        "def test_plain():\n    pass\n")
    assert "WATCHER_TESTS_NO_SKIP=1" in (ROOT / ".ci" / "run").read_text()
    runs = {}
    for flag in ("1", "0"):
        env = dict(os.environ, WATCHER_TESTS_NO_SKIP=flag, PYTHONPATH=str(ROOT))
        runs[flag] = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)],
                                    capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    # (A skip at setup, as skipif's, is reported as an error: a failure all the same.)
    assert runs["1"].returncode == 1 and "1 passed, 1 error" in runs["1"].stdout
    assert "no frobnicator here" in runs["1"].stdout and "WATCHER_TESTS_NO_SKIP=1 forbids it" in runs["1"].stdout
    assert runs["0"].returncode == 0 and "1 passed, 1 skipped" in runs["0"].stdout
