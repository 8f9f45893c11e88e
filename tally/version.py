"""The installed distribution's version, for build-info metrics and the SDK's capabilities."""

from __future__ import annotations

from importlib import metadata

try:
    VERSION = metadata.version("tally")
except metadata.PackageNotFoundError:  # running from a source tree that is not installed
    VERSION = "0+unknown"
