"""The SDK holds only the product (issue 43): an edge application that embeds it, or runs one
device with ``tally client``, loads nothing of the load tester (``tally.loadtest``, which plugs in
through ``tally.client.hooks``) and none of the packages only the load tester installs
(``tally[loadtest]``: behaviour profiles in YAML typed by pydantic, rich progress bars).

Each check runs in a fresh interpreter: in this one, other tests have long imported everything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What only tally[loadtest] installs, as top-level import names.
LOADTEST_ONLY = ("tally.loadtest", "yaml", "pydantic", "rich")


def _loaded_after(imports: str) -> list[str]:
    """The modules of LOADTEST_ONLY loaded once ``imports`` (a statement) has run."""
    script = (f"import json, sys\n{imports}\n"
              f"print(json.dumps(sorted(m for m in sys.modules for p in {LOADTEST_ONLY!r}\n"
              f"                        if m == p or m.startswith(p + '.'))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                          check=True)
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("imports", [
    "import tally.client",
    "from tally.client import ClientMetrics, Device, DeviceHooks, OnnxModel",
    "import tally.client.device",
    "import tally.client.hooks",
    "import tally.cli.client_run",
])
def test_the_sdk_loads_nothing_of_the_load_tester(imports: str) -> None:
    assert _loaded_after(imports) == []


def test_the_check_sees_the_load_tester_when_it_is_loaded() -> None:
    """The control: the same check run on the load tester finds it."""
    loaded = _loaded_after("import tally.loadtest.fleet")
    assert "tally.loadtest.fleet" in loaded and "rich" in loaded
