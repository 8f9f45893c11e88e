"""``AggregatorControl``: what the coordinator calls to open a session, await its sums and close it.

Only cohort sums leave this way (``CohortSum``): the packed total, who contributed and who
dropped, or why the session aborted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import NoReturn

import grpc

from tally import logs
from tally.security import TicketVerifier
from tally.wire.convert import cohort_sum_to_proto
from tally.wire.v1 import aggregator_pb2, aggregator_pb2_grpc

from aggregator.admission import admit
from aggregator.errors import Rejected, abort
from aggregator.metrics import AggregatorMetrics
from aggregator.registry import SessionRegistry
from aggregator.session import Session

log = logging.getLogger("tally.aggregator.control")


class ControlServicer(aggregator_pb2_grpc.AggregatorControlServicer):
    """``address`` gives the host:port devices should use, known only once the server is bound."""

    def __init__(
        self,
        aggregator_id: str,
        verifier: TicketVerifier,
        registry: SessionRegistry,
        metrics: AggregatorMetrics,
        clock: Callable[[], float],
        address: Callable[[], str],
    ) -> None:
        self._id = aggregator_id
        self._verifier = verifier
        self._registry = registry
        self._metrics = metrics
        self._clock = clock
        self._address = address

    async def OpenSession(
        self, request: aggregator_pb2.OpenSessionRequest, context: grpc.aio.ServicerContext
    ) -> aggregator_pb2.OpenSessionResponse:
        try:
            plan = admit(request, self._verifier, self._id, self._clock())
            session = Session(plan, self._metrics, self._registry.finished)
            self._registry.add(session)
        except Rejected as rejected:
            await self._refuse(context, rejected, "open session refused")
        session.start()
        return aggregator_pb2.OpenSessionResponse(
            session_id=session.session_id, address=self._address()
        )

    async def AwaitResult(
        self, request: aggregator_pb2.AwaitResultRequest, context: grpc.aio.ServicerContext
    ) -> aggregator_pb2.CohortSum:
        try:
            session = self._registry.get(request.session_id)
            future = session.result(request.sum_id)
        except Rejected as rejected:
            await self._refuse(context, rejected, "await result refused")
        # Shielded: a caller that gives up (its deadline) must not cancel the session's future.
        result = await asyncio.shield(future)
        spec = session.config.sum_spec(request.sum_id)
        return cohort_sum_to_proto(session.session_id, spec, result)

    async def CloseSession(
        self, request: aggregator_pb2.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> aggregator_pb2.CloseSessionResponse:
        self._registry.close(
            request.session_id, f"by the coordinator: {request.reason or 'no reason given'}"
        )
        logs.event(log, "session closed", session_id=request.session_id, reason=request.reason)
        return aggregator_pb2.CloseSessionResponse()

    async def _refuse(
        self, context: grpc.aio.ServicerContext, rejected: Rejected, what: str
    ) -> NoReturn:
        self._metrics.reject(rejected.reason, rejected.status)
        logs.event(log, what, level=logging.WARNING, status=rejected.status,
                   reason=rejected.reason, detail=rejected.message)
        await abort(context, rejected)
