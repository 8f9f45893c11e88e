"""Chunked, resumable, verified model download, and a content-addressed cache.

Models may be far larger than one gRPC message, and a phone's connection breaks: the blob comes
as a stream of chunks, a broken stream resumes from the last byte received, and the SHA-256 of
the whole blob is checked before anything uses it (a mismatch discards it and starts over).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import tempfile
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from tally import logs
from tally.client.retry import RETRYABLE, RetryPolicy, pause
from tally.security.files import private_dir
from tally.wire.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)

Metadata = Sequence[tuple[str, str]]


class DownloadError(Exception):
    """The blob could not be obtained intact (protocol violation or repeated corruption)."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ModelCache:
    """Blobs by digest: the last ``max_entries`` in memory, all of them on disk when a
    ``directory`` is given (a restarted device skips the download). Disk entries are verified
    on read, so a corrupted file is a miss, never a wrong model."""

    def __init__(self, directory: Path | None = None, max_entries: int = 2) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.directory = Path(directory) if directory is not None else None
        self.max_entries = max_entries
        self._memory: OrderedDict[str, bytes] = OrderedDict()
        if self.directory is not None:
            private_dir(self.directory)

    def get(self, digest: str) -> bytes | None:
        data = self._memory.get(digest)
        if data is not None:
            self._memory.move_to_end(digest)
            return data
        if self.directory is None or not _is_hex_digest(digest):
            return None
        path = self.directory / digest
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if sha256_hex(data) != digest:
            path.unlink(missing_ok=True)
            return None
        self._remember(digest, data)
        return data

    def put(self, digest: str, data: bytes) -> None:
        if sha256_hex(data) != digest:
            raise ValueError("refusing to cache a blob under a digest that is not its SHA-256")
        self._remember(digest, data)
        if self.directory is not None and not (self.directory / digest).exists():
            # Write then rename: a crash never leaves a truncated file under a valid name.
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".partial-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.directory / digest)

    def _remember(self, digest: str, data: bytes) -> None:
        self._memory[digest] = data
        self._memory.move_to_end(digest)
        while len(self._memory) > self.max_entries:
            self._memory.popitem(last=False)


def _is_hex_digest(digest: str) -> bool:
    return len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)


@dataclass
class Downloader:
    """Fetches one blob through ``Coordinator.DownloadModel``.

    ``metadata`` returns the current call metadata (the bearer token); ``reauthenticate`` is
    awaited once when the coordinator refuses the token (it restarted with a new secret).
    """

    stub: coordinator_pb2_grpc.CoordinatorStub
    metadata: Callable[[], Awaitable[Metadata]]
    reauthenticate: Callable[[], Awaitable[None]]
    policy: RetryPolicy
    rng: random.Random
    stop: asyncio.Event | None = None
    on_bytes: Callable[[int], None] = lambda n: None
    on_retry: Callable[[str, grpc.StatusCode], None] = lambda method, code: None
    on_mismatch: Callable[[], None] = lambda: None
    max_corrupt: int = 3
    resumed: int = field(default=0, init=False)

    async def fetch(self, version: str, digest: str = "") -> tuple[bytes, str]:
        """(blob, its digest). ``digest`` empty: accept the digest the chunks announce (for
        floating versions such as ``latest.onnx``), still verified against the bytes."""
        for _ in range(self.max_corrupt):
            data, announced = await self._assemble(version, digest)
            actual = sha256_hex(data)
            if actual == announced and digest in ("", actual):
                return data, actual
            self.on_mismatch()
            logs.event(log, "model digest mismatch", logging.WARNING, version=version,
                       expected=digest or announced, actual=actual)
        raise DownloadError(f"{version}: {self.max_corrupt} downloads in a row failed the SHA-256 check")

    async def _assemble(self, version: str, digest: str) -> tuple[bytes, str]:
        buf = bytearray()
        announced = digest
        total: int | None = None
        attempt = 0
        reauthenticated = False
        while True:
            request = coordinator_pb2.DownloadModelRequest(
                model_version=version, digest=announced, offset=len(buf)
            )
            if buf:
                self.resumed += 1
            try:
                call = self.stub.DownloadModel(
                    request, metadata=await self.metadata(), timeout=self.policy.call_timeout
                )
                async for chunk in call:
                    if chunk.offset != len(buf):
                        raise DownloadError(f"{version}: chunk at offset {chunk.offset}, expected {len(buf)}")
                    if announced and chunk.digest and chunk.digest != announced:
                        raise DownloadError(f"{version}: chunks announce digest {chunk.digest}, expected {announced}")
                    announced = announced or chunk.digest
                    total = chunk.total_size
                    buf += chunk.data
                    self.on_bytes(len(chunk.data))
                    attempt = 0  # progress: the next break starts its backoff afresh
                if total is None:
                    raise DownloadError(f"{version}: the coordinator sent no chunk")
                if len(buf) > total:
                    raise DownloadError(f"{version}: {len(buf)} bytes received for a {total}-byte blob")
                if len(buf) == total:
                    return bytes(buf), announced
                code = grpc.StatusCode.UNAVAILABLE  # the stream ended early: resume like a break
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.UNAUTHENTICATED and not reauthenticated:
                    reauthenticated = True
                    await self.reauthenticate()
                    continue
                if code == grpc.StatusCode.FAILED_PRECONDITION and not digest and buf:
                    # A floating version moved on while we were resuming: start the new blob.
                    buf.clear()
                    announced, total = "", None
                    continue
                if code not in RETRYABLE:
                    raise
            if self.policy.exhausted(attempt):
                raise DownloadError(f"{version}: gave up after {attempt + 1} attempts ({code.name})")
            self.on_retry("DownloadModel", code)
            logs.event(log, "model download interrupted", version=version, offset=len(buf), code=code.name)
            await pause(self.policy.delay(attempt, self.rng), self.stop)
            attempt += 1
