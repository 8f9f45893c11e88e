"""The README and the documentation work from a clone: the README is a landing page whose links
point inside the repository, and every `tally` command in a shell block of the README or of a
docs page parses with today's options."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tally.cli import COMMANDS, build_parser

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
PAGES = sorted((REPO / "docs").glob("*.md"))
# What a reader (or the shell) substitutes.
PLACEHOLDERS = {"<hex>": "00ff", "$(JOB_COMPLETION_INDEX)": "0", "$(jq -r .credential deploy/phone-0001.json)": "00ff"}


def test_readme_is_a_landing_page_whose_links_resolve_inside_the_repository():
    assert len(README.splitlines()) <= 200
    targets = re.findall(r"\]\(([^)#\s]+)\)", README)
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert {"docs/quickstart.md", "docs/job-spec.md", "docs/embedding.md", "docs/DESIGN.md"} <= set(local)
    for target in local:
        assert not target.startswith(".."), target
        assert (REPO / target).exists(), target
    assert "../shared" not in README


def _commands() -> list[list[str]]:
    """Every `.venv/bin/tally ...` or `tally ...` line of the shell blocks of the README and the
    docs pages, continuations joined."""
    out = []
    texts = [README, *(page.read_text() for page in PAGES)]
    for block in (b for text in texts for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith((".venv/bin/tally ", "tally ")):
                argv = shlex.split(line, comments=True)[1:]
                # The command ends where the shell takes over: a redirection, a pipe, a list.
                ends = [i for i, a in enumerate(argv) if a in (">", ">>", "|", "&&", "||", ";", "&")]
                argv = argv[:ends[0]] if ends else argv
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


def test_running_the_pieces_goes_step_by_step():
    """docs/running.md started with one block of 13 commands; each step is now its own, numbered
    and explained, and none repeats the coordinator flags the environment holds."""
    text = (REPO / "docs" / "running.md").read_text()
    steps = re.findall(r"(?m)^### (\d+)\. ", text)
    assert [int(n) for n in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 6, steps
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        commands = [line for line in block.replace("\\\n", " ").splitlines() if "tally " in line]
        assert len(commands) <= 2, commands
    assert "TALLY_COORDINATOR" in text
