import subprocess
import sys

import pytest

from lorafarm.cli import build_parser


def _subcommands():
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return sorted(action.choices)


def test_top_level_help():
    proc = subprocess.run([sys.executable, "-m", "lorafarm", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for name in _subcommands():
        assert name in proc.stdout


@pytest.mark.parametrize("name", _subcommands())
def test_help_for_every_subcommand(name, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([name, "--help"])
    assert exc.value.code == 0
    assert "usage: lorafarm " + name in capsys.readouterr().out


def test_unknown_command_is_one_line_exit_2():
    proc = subprocess.run([sys.executable, "-m", "lorafarm", "nosuch"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
