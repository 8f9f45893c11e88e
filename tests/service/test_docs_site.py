"""The documentation site: built from docs/ by MkDocs with warnings as errors, which also checks
every internal link and anchor, that every page is in the navigation, and the API reference
rendered from the SDK's docstrings; and no page speaks of issue numbers, which mean nothing to a
reader."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    for page in ("quickstart", "concepts", "running", "job-spec", "kubernetes", "operating", "embedding",
                 "sdk-api", "algorithms", "adding-an-algorithm", "privacy", "security", "load-testing", "benchmarks",
                 "contributing"):
        assert (site / f"{page}.html").exists(), page
    api = (site / "sdk-api.html").read_text()
    assert 'id="tally.client.device.Device.run"' in api and 'id="tally.algorithms.base.LocalTrainer"' in api
    recipe = (site / "adding-an-algorithm.html").read_text()  # the contract, from its docstrings
    assert all(f'id="tally.algorithms.base.{name}"' in recipe for name in ("StepSpec", "ServerAlgorithm.init",
                                                                          "Options"))


    # Opened from disk (file://) every link must name a file, not a directory whose index.html only
    # a web server would serve; and the header links the repository.
    home = (site / "index.html").read_text()
    links = set(re.findall(r'href="([^"#:?]+)"', home))
    assert "quickstart.html" in links and "running.html" in links, sorted(links)
    assert not [link for link in links if link.endswith("/") and link not in (".", "./")], sorted(links)
    assert 'href="https://github.com/' in home


def test_no_page_refers_to_issue_numbers():
    pages = [p for p in (REPO / "docs").rglob("*.md") if "results" not in p.parts] + [REPO / "README.md"]
    found = [(p.name, m.group(0)) for p in pages for m in re.finditer(r"\b[Ii]ssues? #?\d+", p.read_text())]
    assert not found, found


def test_load_testing_opens_with_a_first_load_test_and_keeps_its_history_on_a_page_of_its_own():
    """Issue 39: the page began with 10,000-device runs and dated decisions and retractions."""
    page = (REPO / "docs" / "load-testing.md").read_text()
    first = page.split("\n## ")[1]
    assert first.startswith("Your first load test\n")
    (command,) = re.findall(r"```bash\n(.+?)\n```", first)
    assert command == ".venv/bin/python bench/fleet.py --devices 300 --cohort 60 --rounds 2"
    assert "under a minute" in first and "**A good result**" in first
    # What was decided, dropped or found wrong, and when, is the history's.
    assert not re.search(r"decided 20\d\d|found wrong|was wrong|\bdropped \(", page)
    history = (REPO / "docs" / "load-testing-history.md").read_text()
    assert "was wrong" in history and "decided 2026-11-27" in history
    assert "(load-testing-history.md)" in page
    assert "load-testing-history.md" in (REPO / "mkdocs.yml").read_text()
