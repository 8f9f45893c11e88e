"""A real Prometheus server (Debian package ``prometheus``) for the tests that scrape Tally."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from support import tools
from support.deploy import free_port

PROMTOOL, PROMETHEUS = shutil.which("promtool"), shutil.which("prometheus")
_PACKAGE = "(Debian package prometheus; `make test` installs it)"
needs_promtool = tools.needs(None if PROMTOOL else f"promtool is not installed {_PACKAGE}")
needs_prometheus = tools.needs(None if PROMETHEUS else f"prometheus is not installed {_PACKAGE}")


class LivePrometheus:
    """A Prometheus server on 127.0.0.1 with ``config`` (global settings, rule files, scrape
    configs), queried through its HTTP API."""

    def __init__(self, directory: Path, config: dict[str, Any]) -> None:
        self.port = free_port()
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={directory / 'prometheus.yml'}", f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    @classmethod
    def every_second(cls, directory: Path, rules: Path, targets: dict[str, list[int]]) -> LivePrometheus:
        """Scrapes ``job name -> local ports`` and evaluates ``rules`` every second."""
        return cls(directory, {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}]}
                               for job, ports in targets.items()],
        })

    def _api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                body = json.loads(reply.read())
        except urllib.error.HTTPError as error:
            if error.code == 503:  # still starting (its storage is not open yet): an OSError to wait out
                raise
            raise AssertionError(f"{params}: {error.read().decode()}") from None  # a query it cannot run
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self._api("query", query=expr)["result"]

    def series(self, match: str) -> list[dict[str, str]]:
        return self._api("series", **{"match[]": match})

    def alerts(self) -> list[dict[str, Any]]:
        return self._api("alerts")["alerts"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def until(self, expr: str, predicate: Callable[[float], bool], deadline_s: float = 60.0) -> float:
        """Poll ``expr`` until ``predicate(value)`` holds."""
        end = time.monotonic() + deadline_s
        last = None
        while time.monotonic() < end:
            try:
                last = self.value(expr)
            except OSError:  # not listening yet, or not ready to answer queries
                last = None
            if last is not None and predicate(last):
                return last
            time.sleep(0.2)  # nothing to wait on but the next scrape or evaluation
        raise AssertionError(f"{expr} = {last} after {deadline_s} s")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
