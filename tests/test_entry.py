"""harness/entry.py: a module run through it imports with gc's collections paused, runs with
them on and its imports frozen, sees its own command line and exits with what main returns."""

import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_module_imports_with_the_collector_paused_and_exits_with_what_main_returns(tmp_path):
    (tmp_path / "probe.py").write_text(textwrap.dedent("""
        import gc
        import sys

        IMPORTED_WITH_COLLECTOR = gc.isenabled()

        def main():
            print(IMPORTED_WITH_COLLECTOR, gc.isenabled(), gc.get_freeze_count() > 0, sys.argv[1:])
            return 3
    """))
    done = subprocess.run([sys.executable, "-m", "harness.entry", "probe", "--flag", "x"], cwd=REPO,
                          env={"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip() == "False True True ['--flag', 'x']"


def test_without_a_module_it_says_how_to_call_it():
    done = subprocess.run([sys.executable, "-m", "harness.entry"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "usage: python -m harness.entry MODULE" in done.stderr


def test_the_shardbench_command_runs_the_cli_through_entry_and_ends_quietly_when_its_reader_does():
    (script,) = metadata.entry_points(group="console_scripts", name="shardbench")
    assert script.value == "harness.entry:shardbench"
    command = Path(sys.executable).parent / "shardbench"
    # The installed command, its listing piped into `head`: SIGPIPE ends it as it does other Unix
    # tools, without a traceback. (The version it prints: tests/test_cli.py, in this process.)
    piped = subprocess.run(f"{command} list --suite full | head -1", shell=True, capture_output=True, text=True,
                           timeout=120)
    assert len(piped.stdout.splitlines()) == 1 and "/seed0 " in piped.stdout and piped.stderr == ""  # a cell
