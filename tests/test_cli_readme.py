"""The README works from a clone (issue 9, items 4 and 10): its links point inside the repository,
and every `tally` command in its shell blocks parses with today's options."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tally.cli import COMMANDS, build_parser

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
PLACEHOLDERS = {"<hex>": "00ff", "$(JOB_COMPLETION_INDEX)": "0"}  # what a reader substitutes


def test_readme_links_resolve_inside_the_repository():
    targets = re.findall(r"\]\(([^)#\s]+)\)", README)
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert "docs/job-spec.md" in local and "examples/" in local and "docs/DESIGN.md" in local
    for target in local:
        assert not target.startswith(".."), target
        assert (REPO / target).exists(), target
    assert "../shared" not in README


def _commands() -> list[list[str]]:
    """Every `.venv/bin/tally ...` line of the README's shell blocks, continuations joined."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith(".venv/bin/tally "):
                argv = shlex.split(line, comments=True)[1:]
                for placeholder, value in PLACEHOLDERS.items():
                    argv = [a.replace(placeholder, value) for a in argv]
                out.append(argv)
    return out


def test_every_tally_command_in_the_readme_parses():
    commands = _commands()
    assert len(commands) >= 10
    for argv in commands:
        assert argv[0] in COMMANDS, argv
        try:
            args = build_parser(argv[0]).parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"README command does not parse ({exc.code}): tally {' '.join(argv)}")
        assert callable(args.run)
    submitted = [a for argv in commands if argv[:2] == ["job", "submit"] for a in argv[2:3]]
    assert submitted and all((REPO / path).exists() for path in submitted), submitted
