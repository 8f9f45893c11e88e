"""``AggregatorControl``: what the coordinator calls to open a session, await its sums and close it.

Only cohort sums leave this way (``CohortSum``): the packed total, who contributed and who
dropped, or why the session aborted.

AwaitResult and CloseSession act on an open session, so they must prove they come from whoever
opened it. The session ticket cannot: every cohort member holds it. So the call carries the
session's owner token (``tally-owner-token-bin`` metadata), which only the coordinator can derive;
the aggregator compares its SHA-256 with the hash the session was opened with, in constant time.
A call without a well-formed token is refused before any session is looked up.

Under mutual TLS the certificate is checked first: control calls are admitted only from the
coordinator's identity (``controller``, the CN ``tally certs`` gives it), so a device presenting
its own certificate cannot reach this API at all. Without mutual TLS the owner token (and, for
OpenSession, the coordinator-signed ticket) is the boundary.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from collections.abc import Callable
from typing import Any, NoReturn

import grpc

from tally import logs
from tally.aggregator.admission import admit
from tally.aggregator.errors import Rejected, abort
from tally.aggregator.held_sessions import HeldSessions
from tally.aggregator.metrics import AggregatorMetrics
from tally.aggregator.session import Session
from tally.security import AuthError, TicketVerifier, owner_token_from_metadata
from tally.security.tls import peer_identity
from tally.wire.sums import cohort_sum_to_proto
from tally.wire.v1 import aggregator_pb2, aggregator_pb2_grpc

log = logging.getLogger(__name__)


class ControlServicer(aggregator_pb2_grpc.AggregatorControlServicer):
    """``address`` gives the host:port devices should use, known only once the server is bound."""

    def __init__(
        self,
        aggregator_id: str,
        verifier: TicketVerifier,
        sessions: HeldSessions,
        metrics: AggregatorMetrics,
        clock: Callable[[], float],
        address: Callable[[], str],
        controller: str,
    ) -> None:
        self._id = aggregator_id
        self._controller = controller
        self._verifier = verifier
        self._sessions = sessions
        self._metrics = metrics
        self._clock = clock
        self._address = address

    async def OpenSession(
        self, request: aggregator_pb2.OpenSessionRequest,
        context: grpc.aio.ServicerContext[aggregator_pb2.OpenSessionRequest, aggregator_pb2.OpenSessionResponse],
    ) -> aggregator_pb2.OpenSessionResponse:
        try:
            self._check_peer(context)
            plan = admit(request, self._verifier, self._id, self._clock())
            session = Session(plan, self._metrics, self._sessions.finished)
            self._sessions.add(session)
        except Rejected as rejected:
            await self._refuse(context, rejected, "open session refused")
        self._metrics.leader_epoch.set(self._sessions.leader_epoch)
        session.start()
        return aggregator_pb2.OpenSessionResponse(
            session_id=session.session_id, address=self._address()
        )

    async def AwaitResult(
        self, request: aggregator_pb2.AwaitResultRequest,
        context: grpc.aio.ServicerContext[aggregator_pb2.AwaitResultRequest, aggregator_pb2.CohortSum],
    ) -> aggregator_pb2.CohortSum:
        try:
            self._check_peer(context)
            presented = self._owner_token(context)
            session = self._sessions.get(request.session_id)
            self._check_owner(session, presented)
            future = session.result(request.sum_id)
        except Rejected as rejected:
            await self._refuse(context, rejected, "await result refused")
        # Shielded: a caller that gives up (its deadline) must not cancel the session's future.
        result = await asyncio.shield(future)
        spec = session.config.sum_spec(request.sum_id)
        return cohort_sum_to_proto(session.session_id, spec, result)

    async def CloseSession(
        self, request: aggregator_pb2.CloseSessionRequest,
        context: grpc.aio.ServicerContext[aggregator_pb2.CloseSessionRequest, aggregator_pb2.CloseSessionResponse],
    ) -> aggregator_pb2.CloseSessionResponse:
        try:
            self._check_peer(context)
            if not request.session_id:
                # Closes nothing: the coordinator's health check calls this to know that it reached
                # this API (not the device port) and that this aggregator admits it.
                return aggregator_pb2.CloseSessionResponse()
            presented = self._owner_token(context)
            session = self._sessions.find(request.session_id)
            if session is not None:  # closing what is already gone is a no-op, so it may be retried
                self._check_owner(session, presented)
        except Rejected as rejected:
            await self._refuse(context, rejected, "close session refused")
        self._sessions.close(
            request.session_id, f"by the coordinator: {request.reason or 'no reason given'}"
        )
        logs.event(log, "session closed", session_id=request.session_id, reason=request.reason)
        return aggregator_pb2.CloseSessionResponse()

    async def Fence(
        self, request: aggregator_pb2.FenceRequest,
        context: grpc.aio.ServicerContext[aggregator_pb2.FenceRequest, aggregator_pb2.FenceResponse],
    ) -> aggregator_pb2.FenceResponse:
        try:
            self._check_peer(context)
            epoch = self._verifier.verify_epoch(request.leader_epoch)
        except AuthError as exc:
            await self._refuse(context, Rejected.of(exc), "fence refused")
        except Rejected as rejected:
            await self._refuse(context, rejected, "fence refused")
        closed = self._sessions.fence(epoch)
        self._metrics.leader_epoch.set(self._sessions.leader_epoch)
        logs.event(log, "coordinator leader fenced", leader_epoch=self._sessions.leader_epoch, told=epoch,
                   sessions_closed=closed)
        return aggregator_pb2.FenceResponse(leader_epoch=self._sessions.leader_epoch)

    def _check_peer(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        peer = peer_identity(context)
        if peer is not None and peer != self._controller:
            raise Rejected(
                "PERMISSION_DENIED",
                f"AggregatorControl admits only the coordinator's certificate ({self._controller}), "
                f"not {peer!r}",
                "not_controller",
            )

    @staticmethod
    def _owner_token(context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        try:
            return owner_token_from_metadata(context.invocation_metadata())
        except AuthError as exc:
            raise Rejected(exc.status, exc.message, "not_owner") from None

    @staticmethod
    def _check_owner(session: Session, presented: bytes) -> None:
        if not hmac.compare_digest(hashlib.sha256(presented).digest(), session.plan.owner_sha256):
            raise Rejected(
                "PERMISSION_DENIED",
                f"not the owner of session {session.session_id!r}: only the coordinator that opened "
                "it may await or close it",
                "not_owner",
            )

    async def _refuse(
        self, context: grpc.aio.ServicerContext[Any, Any], rejected: Rejected, what: str
    ) -> NoReturn:
        self._metrics.reject(rejected.reason, rejected.status)
        logs.event(log, what, level=logging.WARNING, status=rejected.status,
                   reason=rejected.reason, detail=rejected.message)
        await abort(context, rejected)
