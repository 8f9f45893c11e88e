"""Aggregators fenced by coordinator leader epochs (issue 38, "failover cannot double-lead"): a
replica that lost the lead without noticing may still hold an old session ticket's key and an
aggregator's address, so the aggregator itself refuses what an older leader asks once a newer one
has said its epoch (signed with the ticket key), and closes what the older one opened."""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric import ed25519

from support.aggregator import CODE, OWNER_TOKENS, connected, plan, rpc_error, run, scrape, sign
from support.stack import in_process
from tally.coordinator.rounds.aggregators import AggregatorPool
from tally.security import TicketSigner, TLSConfig
from tally.wire.v1 import aggregator_pb2


def _of_epoch(deployment, session_id: str, epoch: int):
    """A session the leader of ``epoch`` plans: its ticket carries the epoch."""
    cohort = plan(deployment, session_id, seconds=30.0)
    cohort.request.session_ticket = sign(deployment, cohort.config, leader_epoch=epoch)
    return cohort


def test_a_newer_leaders_epoch_closes_the_old_leaders_sessions_and_refuses_its_tickets(deployment):
    async def scenario():
        async with in_process().aggregator_alone(deployment) as service, connected(deployment, service) as (_, stub):
            def fence(statement: bytes):
                return stub.Fence(aggregator_pb2.FenceRequest(leader_epoch=statement), timeout=10)

            await stub.OpenSession(_of_epoch(deployment, "s-old", 1).request)
            assert scrape(service.metrics_port)["tally_aggregator_coordinator_leader_epoch"] == 1
            # Only the ticket key says an epoch: a forged or malformed statement raises no floor.
            forged = TicketSigner(ed25519.Ed25519PrivateKey.generate()).sign_epoch(2)
            assert await rpc_error(fence(forged)) == (CODE.PERMISSION_DENIED, "leader epoch signature invalid")
            code, detail = await rpc_error(fence(b"\x00" * 8))
            assert code == CODE.PERMISSION_DENIED and "malformed leader epoch" in detail
            assert scrape(service.metrics_port)["tally_aggregator_active_sessions"] == 1

            assert (await fence(deployment.signer.sign_epoch(2))).leader_epoch == 2
            metrics = scrape(service.metrics_port)
            assert metrics["tally_aggregator_coordinator_leader_epoch"] == 2
            assert metrics["tally_aggregator_active_sessions"] == 0
            assert metrics['tally_aggregator_sessions_finished_total{outcome="closed"}'] == 1
            code, _ = await rpc_error(stub.AwaitResult(aggregator_pb2.AwaitResultRequest(
                session_id="s-old", sum_id="update"), metadata=plan(deployment, "s-old").owner_md))
            assert code == CODE.NOT_FOUND

            # The old leader, resumed, cannot open another; nor can a coordinator without an epoch.
            for session_id, epoch in (("s-stale", 1), ("s-alone", 0)):
                assert await rpc_error(stub.OpenSession(_of_epoch(deployment, session_id, epoch).request)) == (
                    CODE.FAILED_PRECONDITION,
                    f"session ticket of coordinator leader epoch {epoch}: a newer leader (epoch 2) has taken "
                    "over, so the old one may open no session")
            # An older statement lowers nothing; the newer leader's own tickets are welcome, and a
            # ticket of a later epoch still raises the floor (its leader fenced another aggregator first).
            assert (await fence(deployment.signer.sign_epoch(1))).leader_epoch == 2
            await stub.OpenSession(_of_epoch(deployment, "s-new", 2).request)
            await stub.OpenSession(_of_epoch(deployment, "s-newer", 3).request)
            assert (await fence(deployment.signer.sign_epoch(2))).leader_epoch == 3  # epoch 2 is told it is old
            metrics = scrape(service.metrics_port)
            assert metrics['tally_aggregator_rejected_total{reason="stale_leader",status="FAILED_PRECONDITION"}'] == 2
            assert metrics["tally_aggregator_active_sessions"] == 1  # s-newer: s-new was closed with epoch 3

    run(scenario)


def test_a_leaders_pool_fences_each_aggregator_as_it_comes_up_and_learns_when_it_is_superseded(deployment):
    """The coordinator side: a new leader's pool says its epoch to an aggregator the moment it finds
    it serving, before any cohort goes there; an aggregator that knows a newer epoch tells the
    old leader, which then stops leading (``CoordinatorService.lost_lead``)."""
    tls = TLSConfig.from_dir(deployment.tls_dir / "coordinator", "coordinator")

    async def scenario():
        async with in_process().aggregator_alone(deployment, mutual=True) as service:
            target = [("agg-a", f"localhost:{service.control_port}")]
            superseded: list[int] = []
            newer = AggregatorPool(target, tls, 1 << 20, OWNER_TOKENS, fence=(5, deployment.signer.sign_epoch(5)),
                                   on_superseded=superseded.append)
            older = AggregatorPool(target, tls, 1 << 20, OWNER_TOKENS, fence=(4, deployment.signer.sign_epoch(4)),
                                   on_superseded=superseded.append)
            try:
                assert await newer.healthy() == ["agg-a"]
                assert scrape(service.metrics_port)["tally_aggregator_coordinator_leader_epoch"] == 5
                assert superseded == []
                assert await older.healthy() == ["agg-a"]
                assert superseded == [5]
                assert await newer.healthy() == ["agg-a"]  # still up: not fenced again
                assert scrape(service.metrics_port)["tally_aggregator_coordinator_leader_epoch"] == 5
            finally:
                await newer.close()
                await older.close()

    run(scenario)
