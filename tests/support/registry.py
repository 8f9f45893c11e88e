"""A real image registry on 127.0.0.1 for the container tests: Debian's ``docker-registry``
(the CNCF distribution registry), plain HTTP on an ephemeral port, its storage in a directory."""

from __future__ import annotations

from pathlib import Path

import yaml

from support import tools
from support.deploy import Service, free_port


class Registry:
    def __init__(self, directory: Path) -> None:
        program = tools.require("docker-registry", "Debian's docker-registry: `make gateway-tools` installs it")
        directory.mkdir(parents=True, exist_ok=True)
        self.address = f"127.0.0.1:{free_port()}"
        config = directory / "config.yml"
        config.write_text(yaml.safe_dump({
            "version": 0.1,
            "log": {"level": "info", "formatter": "text", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(directory / "data")}},
            "http": {"addr": self.address},
        }))
        # It logs on stderr; the line that says it listens is the one to wait for.
        self.service = Service("registry", ["bash", "-c", 'exec "$0" serve "$1" 2>&1', program, str(config)],
                               directory)
        self.service.wait_for(r"listening on " + self.address.replace(".", r"\."), timeout=60)

    def stop(self) -> None:
        self.service.stop()
