"""Operator mistakes get a one-line message naming the problem and a non-zero exit, never a
traceback, and never a side effect such as a mistyped directory filled with fresh secrets
(issue 9, item 7)."""

from __future__ import annotations

import argparse

import pytest

from coordinator import cli as coordinator_cli
from coordinator.store import Store


def _coordinator(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tally")
    coordinator_cli.register(parser.add_subparsers())
    args = parser.parse_args(["coordinator", "--metrics-port", "0", *argv])
    return args.run(args)


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["--tls-dir", "{tmp}/typo"], 2, "--tls-dir {tmp}/typo: no such directory"),
        (["--secrets-dir", "{tmp}/typo"], 2, "--secrets-dir {tmp}/typo: no such directory"),
        (["--insecure", "--listen", "0.0.0.0:0"], 1, "--insecure is allowed only on loopback"),
        (["--insecure", "--listen", "nonsense"], 1, "'nonsense' is not HOST:PORT"),
    ],
)
def test_coordinator_cli_mistakes_are_messages(tmp_path, capsys, argv, code, message):
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert _coordinator(["--state-dir", str(tmp_path / "state"), *argv]) == code
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err and "Traceback" not in err
    assert not (tmp_path / "typo").exists()


def test_a_state_dir_in_use_is_a_message(tmp_path, capsys):
    holder = Store(tmp_path / "state")  # what a running coordinator holds
    try:
        assert _coordinator(["--state-dir", str(tmp_path / "state"), "--insecure", "--listen", "127.0.0.1:0"]) == 1
    finally:
        holder.close()
    err = capsys.readouterr().err
    assert "is in use by another coordinator" in err and "Traceback" not in err
