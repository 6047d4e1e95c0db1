"""`fp16kit --help`: every command, one line each."""

from __future__ import annotations

import re

import pytest

from fp16kit.cli import _COMMANDS, main


def test_help_lists_every_command_on_one_line(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for module in _COMMANDS:
        command = module.replace("_", "-")
        line = re.search(rf"^    {re.escape(command)} +(\S.*)$", out, re.M)
        assert line, f"{command} missing or its summary on another line:\n{out}"
        after = out[line.end() + 1 :].split("\n", 1)[0]
        assert not after.startswith("      "), f"{command}'s summary wraps:\n{out}"


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out
