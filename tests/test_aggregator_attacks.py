"""Misbehaving devices against the real aggregator over gRPC with TLS (issue 12, item 3): a key
of small order or wrong Unmask shares from one device leave the others' sum exact."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np

from secagg_helpers import identities
from tally.secagg.messages import AdvertiseKeys, UnmaskResponse
from tally.secagg.wire import advertise_statement
from test_aggregator import (  # noqa: F401  (deployment is a fixture)
    CODE,
    assert_sum,
    await_sum,
    connected,
    deployment,
    device,
    plan,
    run,
    running,
    scrape,
)


def _small_order_key(message):
    if not isinstance(message, AdvertiseKeys):
        return message
    keys = tuple(dataclasses.replace(k, cipher_public=bytes(32)) for k in message.keys)
    signature = identities(8)[message.sender].sign(advertise_statement(message.ref, message.sender, keys))
    return AdvertiseKeys(message.ref, message.sender, keys, signature)


def _zeroed_shares(message):
    if not isinstance(message, UnmaskResponse):
        return message
    return dataclasses.replace(
        message,
        seed_shares=tuple((o, bytes(len(s))) for o, s in message.seed_shares),
        key_shares=tuple((o, bytes(len(s))) for o, s in message.key_shares),
    )


def test_a_zero_key_excludes_its_sender_and_wrong_shares_are_decoded_around(deployment):
    async def scenario():
        async with running(deployment) as service, connected(deployment, service) as (ch, stub):
            cohort = plan(deployment, "s-attacks")
            await stub.OpenSession(cohort.request)
            tamper = {3: _small_order_key, 2: _zeroed_shares}
            runs = await asyncio.gather(
                *(device(ch, cohort, i, tamper=tamper.get(i, lambda m: m)) for i in range(1, 9)),
                await_sum(stub, cohort, "update"), await_sum(stub, cohort, "count"),
            )
            devices, (_, update), (_, count) = runs[:8], runs[8], runs[9]
            # Device 3's stream is refused with a clear status; nobody else is affected.
            assert devices[2].outcome == "error" and devices[2].code == CODE.INVALID_ARGUMENT
            assert "small order" in devices[2].detail
            others = [1, 2, 4, 5, 6, 7, 8]
            assert_sum(cohort, "update", update, others)
            assert_sum(cohort, "count", count, others)
            assert all(devices[i - 1].outcome == "done" for i in others)
            metrics = scrape(service.metrics_port)
            assert metrics["tally_aggregator_misbehaving_devices_total"] == 1
            assert metrics['tally_aggregator_sessions_finished_total{outcome="completed"}'] == 1

    run(scenario)
