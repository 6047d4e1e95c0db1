"""`fp16kit demo` with an apex recipe: amp.initialize's banner, now on stdout as apex printed it,
would cut the demo's table; it is hidden with the overflow lines unless --verbose."""

from __future__ import annotations

from fp16kit.cli import main

BANNER = "Selected optimization level O2:"


def test_amp_banner_hidden_unless_verbose(capsys):
    args = ["demo", "--epochs", "1", "--steps", "2", "--recipes", "amp-o2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert BANNER not in out
    assert "amp-o2" in out  # the table is there
    assert main([*args, "--verbose"]) == 0
    assert capsys.readouterr().out.count(BANNER) == 1
