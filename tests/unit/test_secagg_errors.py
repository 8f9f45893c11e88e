"""Stale, replayed, out-of-phase, unknown and malformed messages: a typed error, and the
session goes on to the right sum."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from support.secagg import lax_client, make_config, random_inputs, share_pairs, with_shares
from tally.secagg import (
    DuplicateMessage,
    MalformedMessage,
    OutOfPhase,
    SessionRef,
    StaleMessage,
    UnknownSender,
)
from tally.secagg.messages import (
    AdvertiseKeys,
    MaskedInputResponse,
    ShareComplaints,
    ShareDelivery,
    ShareKeysResponse,
    UnmaskRequest,
    UnmaskResponse,
)
from tally.secagg.server import SecAggServer


class Session:
    """A hand-driven cohort, so tests can slip bad messages between the good ones."""

    def __init__(self, n=6, sums=(("a", 6, 20), ("b", 3, 24))):
        self.config = make_config(n, n - 1, 3, sums=sums)
        self.inputs = random_inputs(self.config, np.random.default_rng(0))
        self.server = SecAggServer(self.config)
        self.clients = {i: lax_client(self.config, i) for i in range(1, n + 1)}
        for i, c in self.clients.items():
            for sum_id, v in self.inputs[i].items():
                c.provide_input(sum_id, v)
        self.pending = [m for c in self.clients.values() for m in c.start()]
        self.sent = []

    def deliver(self, outgoing):
        for o in outgoing:
            self.pending += self.clients[o.recipient].receive(o.message)

    def step(self):
        """Hand the server every pending device message, then deliver its answers."""
        batch, self.pending = self.pending, []
        for m in batch:
            self.sent.append(m)
            try:
                self.deliver(self.server.receive(m))
            except (OutOfPhase, StaleMessage):
                # Only stragglers of an Unmask the server closed early may come late.
                assert isinstance(m, UnmaskResponse) and m.sum_id in self.server.results
        return batch

    def finish(self):
        while not self.server.finished:
            self.step()
        for spec in self.config.sums:
            expected = sum(self.inputs[i][spec.sum_id].astype(np.int64) for i in self.clients)
            assert np.array_equal(
                self.server.results[spec.sum_id].total.astype(np.int64), expected % (1 << spec.bits)
            )


def test_replayed_and_stale_messages_are_rejected_and_the_sums_stay_exact():
    s = Session()
    adverts = s.step()
    with pytest.raises(OutOfPhase):
        s.server.receive(adverts[0])  # replayed after its phase closed
    s.step()  # share keys -> deliveries
    s.step()  # no complaints -> masked input of sum a
    masked_a = list(s.pending)
    s.step()
    # Replaying sum a's masked input while sum a is in Unmask.
    with pytest.raises((DuplicateMessage, OutOfPhase)):
        s.server.receive(masked_a[0])
    # Same message for another round, job or session: stale.
    for ref in (
        SessionRef("job", 0, "sess"),
        SessionRef("other-job", 1, "sess"),
        SessionRef("job", 1, "other-session"),
    ):
        with pytest.raises(StaleMessage):
            s.server.receive(dataclasses.replace(masked_a[0], ref=ref))
    s.finish()


def test_duplicate_within_a_phase_is_not_applied_twice():
    s = Session()
    first = s.pending[0]
    s.deliver(s.server.receive(first))
    with pytest.raises(DuplicateMessage, match="already sent advertise_keys"):
        s.server.receive(first)
    s.pending = s.pending[1:]
    s.sent.append(first)
    s.finish()


def test_out_of_phase_unknown_and_malformed_messages():
    s = Session()
    ref = s.config.ref
    with pytest.raises(OutOfPhase, match="advertise_keys"):
        s.server.receive(MaskedInputResponse(ref, "a", 1, b"\x00" * 16))
    with pytest.raises(UnknownSender):
        s.server.receive(dataclasses.replace(s.pending[0], sender=99))
    with pytest.raises(UnknownSender):
        s.server.receive(dataclasses.replace(s.pending[0], sender=0))
    bad_key = dataclasses.replace(
        s.pending[0], keys=(dataclasses.replace(s.pending[0].keys[0], mask_public=b"short"),) + s.pending[0].keys[1:]
    )
    with pytest.raises(MalformedMessage, match="32 bytes"):
        s.server.receive(bad_key)
    with pytest.raises(MalformedMessage, match="keys for sums"):
        s.server.receive(dataclasses.replace(s.pending[0], keys=s.pending[0].keys[:1]))
    s.step()
    shares = s.pending[0]
    assert isinstance(shares, ShareKeysResponse)
    with pytest.raises(MalformedMessage, match="one share per sum"):
        s.server.receive(dataclasses.replace(shares, shares=shares.shares[1:]))
    with pytest.raises(MalformedMessage, match="one check of"):
        s.server.receive(dataclasses.replace(shares, checks=shares.checks[1:]))
    s.step()
    complaints = s.pending[0]
    assert isinstance(complaints, ShareComplaints) and complaints.complaints == ()
    s.step()
    masked = s.pending[0]
    with pytest.raises(MalformedMessage, match="bytes"):
        s.server.receive(dataclasses.replace(masked, data=masked.data + b"\x00"))
    with pytest.raises(StaleMessage, match="sum 'b'"):
        s.server.receive(dataclasses.replace(masked, sum_id="b"))
    s.step()
    unmask = s.pending[0]
    assert isinstance(unmask, UnmaskResponse)
    with pytest.raises(MalformedMessage, match="seed shares"):
        s.server.receive(with_shares(unmask, seeds=share_pairs(unmask.seed_owners, unmask.seed_shares)[1:]))
    s.finish()


def test_unmask_answers_must_name_each_expected_owner_once_with_whole_shares():
    """Every way an Unmask answer can misname its owners or cut its shares is refused with the
    reason; the same shares in another order are accepted and the sums stay exact."""
    s = Session()
    for _ in range(4):
        s.step()
    unmask = s.pending[0]
    assert isinstance(unmask, UnmaskResponse) and not unmask.key_owners and len(unmask.seed_owners) > 2
    seeds = share_pairs(unmask.seed_owners, unmask.seed_shares)
    (a, share_a), (b, share_b) = seeds[0], seeds[1]
    refused = {
        "seed shares": [seeds[1:], seeds[:1] + seeds[:-1], seeds + seeds[:1]],
        "32 bytes": [[(a, share_a[:-1]), (b, share_b)] + seeds[2:], [(a, share_a + b"\x00")] + seeds[1:],
                     [(a, b"")] + seeds[1:]],
        "device indices": [[("one", share_a)] + seeds[1:], [(None, share_a)] + seeds[1:]],
    }
    for reason, variants in refused.items():
        for variant in variants:
            with pytest.raises(MalformedMessage, match=reason):
                s.server.receive(with_shares(unmask, seeds=variant))
    with pytest.raises(MalformedMessage, match="key shares"):
        s.server.receive(with_shares(unmask, keys=seeds[:1]))
    owners = unmask.seed_owners
    shaped_wrong = {"device indices": [{"seed_owners": ((a, b),) + owners[2:]},
                                       {"seed_owners": (a + 0.5,) + owners[1:]},
                                       {"seed_owners": tuple(map(str, owners))},
                                       {"seed_owners": np.array(owners)[::-1].astype(float)}],
                    "seed shares": [{"seed_owners": np.array(owners[1:])}, {"seed_owners": list(owners[1:])}],
                    "32 bytes": [{"seed_shares": list(unmask.seed_shares)}, {"key_shares": None}]}
    for reason, variants in shaped_wrong.items():
        for fields in variants:
            with pytest.raises(MalformedMessage, match=reason):
                s.server.receive(dataclasses.replace(unmask, **fields))
    s.pending[0] = with_shares(unmask, seeds=seeds[::-1])
    s.finish()
    assert not s.server.misbehaving


def test_device_rejects_stale_out_of_phase_and_tampered_messages():
    s = Session(n=5)
    client = s.clients[1]
    with pytest.raises(OutOfPhase):
        client.receive(UnmaskRequest(s.config.ref, "a", (1, 2, 3)))
    s.step()
    s.step()
    # The server forwards ShareDelivery; tamper with one ciphertext addressed to device 1.
    with pytest.raises(StaleMessage):
        client.receive(ShareDelivery(SessionRef("job", 2, "sess"), ()))
    # A delivery that is not for device 1 is refused; the device stays intact.
    fresh = Session(n=5)
    fresh.step()
    held_back = []
    batch, fresh.pending = fresh.pending, []
    for m in batch:
        for o in fresh.server.receive(m):
            if o.recipient == 1:
                held_back.append(o.message)
            else:
                fresh.pending += fresh.clients[o.recipient].receive(o.message)
    delivery = next(m for m in held_back if isinstance(m, ShareDelivery))
    share = delivery.shares[0]
    misrouted = dataclasses.replace(delivery, shares=(dataclasses.replace(share, recipient=2),) + delivery.shares[1:])
    with pytest.raises(MalformedMessage, match="not for me"):
        fresh.clients[1].receive(misrouted)
    unchecked = dataclasses.replace(delivery, shares=(dataclasses.replace(share, check=b""),) + delivery.shares[1:])
    with pytest.raises(MalformedMessage, match="wrong size"):
        fresh.clients[1].receive(unchecked)
    # A flipped ciphertext bit is no reason to abort: the device complains about that share.
    flipped = bytes([share.ciphertext[0] ^ 1]) + share.ciphertext[1:]
    forged = dataclasses.replace(
        delivery, shares=(dataclasses.replace(share, ciphertext=flipped),) + delivery.shares[1:])
    [answer] = fresh.clients[1].receive(forged)
    assert isinstance(answer, ShareComplaints)
    assert [(c.dealer, c.holder) for c in answer.complaints] == [(share.sender, 1)]
    assert fresh.clients[1].phase == "share_verdict"


def test_advertise_keys_message_type_checked():
    s = Session(n=4, sums=(("a", 2, 8),))
    advert = s.pending[0]
    assert isinstance(advert, AdvertiseKeys)
    s.step()
    with pytest.raises(OutOfPhase, match="share_keys"):
        s.server.receive(dataclasses.replace(advert, sender=advert.sender))
