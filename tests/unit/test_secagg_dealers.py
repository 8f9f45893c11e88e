"""No single device can fail a round or push out an honest one (issue 23, findings 2 and 3).

A corrupt dealer (shares on no polynomial, or garbage for one neighbour) is convicted by its own
key and excluded for every device before any masked input; a holder that complains about a good
share is settled by the dealer's key and named; a server that alters a delivery or forges a
complaint gets no key; an Unmask request naming a device outside the neighbourhood is refused.
In process, against the real state machines.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.secagg import ProtocolCohort, identities, lax_client, make_config, random_inputs
from tally.secagg import MalformedMessage, SecAggServer, shamir, sharecheck
from tally.secagg.adversary import CORRUPT_DEALERS, InconsistentDealer
from tally.secagg.client import _AwaitShareVerdict
from tally.secagg.messages import (
    JustifyRequest,
    JustifyResponse,
    MaskedInputResponse,
    SessionRef,
    ShareComplaint,
    ShareComplaints,
    ShareDelivery,
    ShareVerdict,
    UnmaskRequest,
    UnmaskResponse,
)


@pytest.mark.parametrize("consistency", [False, True])
@pytest.mark.parametrize("n, k, t", [(12, 11, 7), (100, 26, 16)])
@pytest.mark.parametrize("adversary", CORRUPT_DEALERS, ids=lambda dealer: dealer.kind)
def test_a_corrupt_dealer_is_excluded_before_any_input_and_the_sum_is_exact(adversary, n, k, t, consistency):
    dealer = 5
    cohort = ProtocolCohort(make_config(n, k, t, consistency=consistency), dealers={dealer: adversary})
    cohort.run()
    server = cohort.server
    assert server.aborted is None, server.aborted
    assert server.excluded.keys() == {dealer} and "fails its check" in server.excluded[dealer]
    assert cohort.refused == {} and cohort.rejected == {}  # the neighbour aimed at stays too
    assert not any(isinstance(m, MaskedInputResponse) and m.sender == dealer for m in cohort.sent)
    result = server.results["s"]
    assert set(result.contributors) == set(range(1, n + 1)) - {dealer}
    assert result.total.tolist() == cohort.exact("s", result.contributors)
    complainers = {m.sender for m in cohort.sent if isinstance(m, ShareComplaints) and m.complaints}
    neighbours = set(cohort.config.neighbours(dealer).tolist())
    assert complainers == (neighbours if adversary is InconsistentDealer else {min(neighbours)})


def test_without_the_check_shares_on_no_polynomial_fail_the_round_after_every_input(monkeypatch):
    """The control: what finding 2 was. Every holder accepts its share, every device sends its
    masked input, and Unmask cannot rebuild the dealer's seed."""
    monkeypatch.setattr(sharecheck, "passes", lambda plaintext, check: True)
    cohort = ProtocolCohort(make_config(12, 11, 7), dealers={5: InconsistentDealer})
    cohort.run()
    assert cohort.server.excluded == {}
    assert sum(isinstance(m, MaskedInputResponse) for m in cohort.sent) == 12
    assert cohort.server.aborted is not None and cohort.server.results == {}


def _signed_complaint(config, delivery: ShareDelivery, dealer: int, holder: int, key=None) -> ShareComplaint:
    share = next(s for s in delivery.shares if s.sender == dealer)
    statement = sharecheck.complaint_statement(config.ref, share.sum_id, dealer, holder, share.ciphertext, share.check)
    return ShareComplaint(share.sum_id, dealer, holder, (key or identities(config.n)[holder]).sign(statement))


def test_a_false_complaint_is_settled_by_the_dealers_key_and_names_the_complainer():
    config = make_config(10, 9, 6, consistency=True)
    liar, dealer = 3, 7
    cohort = ProtocolCohort(config)

    def complain(message):
        if isinstance(message, ShareComplaints) and message.sender == liar:
            lie = _signed_complaint(config, cohort.server.deliveries[liar], dealer, liar)
            return dataclasses.replace(message, complaints=(lie,))
        return message

    cohort.run(tamper_client=complain)
    server = cohort.server
    assert server.aborted is None and server.excluded == {}
    assert server.misbehaving == {liar: f"complained about a good share from device {dealer}"}
    assert any(isinstance(m, JustifyResponse) and m.sender == dealer for m in cohort.sent)
    result = server.results["s"]
    # The liar's own device sees a settlement of a complaint it never made, and leaves.
    assert "did not make" in str(cohort.refused[liar])
    assert set(result.contributors) == set(range(1, 11)) - {liar}
    assert result.total.tolist() == cohort.exact("s", result.contributors)


def _dealt(config) -> tuple[dict, dict[int, ShareDelivery]]:
    """Clients 1..n through ShareKeys with a real server: (clients, each one's ShareDelivery, not
    yet handed to it)."""
    server = SecAggServer(config)
    clients = {i: lax_client(config, i) for i in range(1, config.n + 1)}
    for i, c in clients.items():
        for sum_id, vector in random_inputs(config, np.random.default_rng(0))[i].items():
            c.provide_input(sum_id, vector)
    pending = [m for c in clients.values() for m in c.start()]
    deliveries = {}
    while not deliveries:
        out = []
        for m in pending:
            out += server.receive(m)
        pending = []
        for o in out:
            if isinstance(o.message, ShareDelivery):
                deliveries[o.recipient] = o.message
            else:
                pending += clients[o.recipient].receive(o.message)
    return clients, deliveries


def test_an_aggregator_that_alters_a_delivery_or_forges_a_complaint_gets_no_key():
    """A key would open one honest holder's share of an honest dealer to the aggregator; t of
    them would rebuild the dealer's secrets. The dealer reveals a key only for a complaint
    signed by the holder over exactly what the dealer sent it."""
    config = make_config(6, 5, 3)
    clients, deliveries = _dealt(config)
    victim, dealer = 2, 4
    share = next(s for s in deliveries[victim].shares if s.sender == dealer)
    flipped = dataclasses.replace(share, ciphertext=bytes([share.ciphertext[0] ^ 1]) + share.ciphertext[1:])
    altered = dataclasses.replace(deliveries[victim], shares=tuple(
        flipped if s is share else s for s in deliveries[victim].shares))
    [answer] = clients[victim].receive(altered)
    assert [(c.dealer, c.holder) for c in answer.complaints] == [(dealer, victim)]  # it complains
    for i in clients.keys() - {victim}:
        clients[i].receive(deliveries[i])
    about_altered = JustifyRequest(config.ref, answer.complaints)
    forged = JustifyRequest(config.ref, (_signed_complaint(
        config, deliveries[victim], dealer, victim, key=identities(config.n)[1]),))
    for request in (about_altered, forged):
        with pytest.raises(MalformedMessage, match="not about the share I sent"):
            clients[dealer].receive(request)
    # The control: the holder's own signature over the genuine share gets the key, and it
    # opens exactly that share.
    genuine = JustifyRequest(config.ref, (_signed_complaint(config, deliveries[victim], dealer, victim),))
    [revealed] = clients[dealer].receive(genuine)
    assert isinstance(revealed, JustifyResponse) and [k.holder for k in revealed.keys] == [victim]
    # That key does not open the altered ciphertext the victim complained about: it refuses to
    # go on rather than mask with a dealer whose share it does not hold.
    with pytest.raises(MalformedMessage, match="not settled"):
        clients[victim].receive(ShareVerdict(config.ref, (), revealed.keys))


@pytest.mark.parametrize(("complaints", "refusal"), [
    (20_000, "20000 complaints to justify, but I dealt 5 shares"),
    (2, "a complaint to justify is repeated"),
    (None, "a second JustifyRequest in this session"),
])
def test_a_justify_request_is_bounded_by_the_shares_dealt_and_comes_once(complaints, refusal):
    """Issue 38, problem 7: one genuine complaint repeated 20,000 times cost the honest dealer
    2.9 s of signature checks and 20,000 copies of one key, and it answered every further
    request. Now a request naming more complaints than shares dealt, or one complaint twice, is
    refused before any signature is checked, and so is any request after one was answered
    (None: the genuine request, answered, then sent again)."""
    config = make_config(6, 5, 3)
    clients, deliveries = _dealt(config)
    for i, client in clients.items():
        client.receive(deliveries[i])
    dealer, holder = 4, 2
    genuine = _signed_complaint(config, deliveries[holder], dealer, holder)
    if complaints is None:
        [answer] = clients[dealer].receive(JustifyRequest(config.ref, (genuine,)))
        assert [k.holder for k in answer.keys] == [holder]
        complaints = 1
    with pytest.raises(MalformedMessage, match=refusal):
        clients[dealer].receive(JustifyRequest(config.ref, (genuine,) * complaints))


def test_a_verdict_that_leaves_a_complaint_unsettled_or_excludes_a_stranger_is_refused():
    config = make_config(6, 5, 3)
    holder = lax_client(config, 1)
    holder.secrets["s"].complained[4] = (b"x" * 10, b"y" * sharecheck.CHECK_BYTES)
    holder._phase = _AwaitShareVerdict(holder, frozenset({2, 3, 4, 5, 6}))
    with pytest.raises(MalformedMessage, match="not settled"):
        holder.receive(ShareVerdict(config.ref, (), ()))
    with pytest.raises(MalformedMessage, match="did not deal me shares"):
        holder.receive(ShareVerdict(config.ref, (1, 4), ()))
    with pytest.raises(MalformedMessage, match="once each, ascending"):
        holder.receive(ShareVerdict(config.ref, (4, 4), ()))


@settings(max_examples=60, deadline=None)
@given(t=st.integers(2, 12), extra=st.integers(1, 8), data=st.data())
def test_shares_on_no_polynomial_fail_some_holder_whatever_check_the_dealer_publishes(t, extra, data):
    """Soundness of the check: the dealer fits h to the first t holders as best it can (any h
    must agree with t of them); once a share lies off the polynomial, a holder fails."""
    holders = t + extra
    xs = np.arange(1, holders + 1)
    secrets = [bytes(data.draw(st.binary(min_size=32, max_size=32))) for _ in range(2)]
    polynomials = shamir.polynomials(secrets, t)
    blinding = shamir.random_polynomials(sharecheck.ROWS, t)
    shares = shamir.evaluate(polynomials, xs).transpose(1, 0, 2).reshape(holders, -1)
    blinds = shamir.evaluate(blinding[:, :, None], xs)[:, :, 0].T
    off = data.draw(st.lists(st.integers(0, holders - 1), min_size=1, unique=True))
    delta = data.draw(st.integers(1, shamir.P - 1))
    term = data.draw(st.integers(0, sharecheck.TERMS - 1))
    shares[off, term] = (shares[off, term] + delta) % shamir.P
    rows = np.concatenate([shares, blinds], axis=1).astype("<u4")
    digest = sharecheck.digest(SessionRef("j", 1, "s"), "s", 1, [r.tobytes() for r in rows])
    c = sharecheck.challenge(digest)
    # What each holder's values combine to; the dealer's h must be one polynomial of degree < t.
    products = (c[None, :, :] * rows[:, None, :sharecheck.TERMS].astype(np.uint64)) % shamir.P
    combined = (rows[:, sharecheck.TERMS:].astype(np.uint64) + products.sum(axis=2)) % shamir.P
    fitted = np.stack([_interpolate(xs[:t], combined[:t, r], xs) for r in range(sharecheck.ROWS)], axis=1)
    verdicts = [sharecheck.passes(rows[i].tobytes(), sharecheck.check_bytes(digest, fitted[i])) for i in range(holders)]
    error = np.zeros(holders, dtype=np.uint64)
    error[off] = delta
    on_polynomial = np.array_equal(_interpolate(xs[:t], error[:t], xs), error)  # e.g. every share moved alike
    assert all(verdicts[:t])  # fitted through them
    assert on_polynomial or not all(verdicts)
    honest_h = sharecheck.check_polynomials(polynomials, blinding, c)
    honest_values = sharecheck.evaluate_rows(honest_h[None], xs[None])[0]
    clean = set(range(holders)) - set(off)
    assert all(sharecheck.passes(rows[i].tobytes(), sharecheck.check_bytes(digest, honest_values[i])) for i in clean)


def _interpolate(xs: np.ndarray, ys: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Lagrange interpolation over GF(p), in Python integers (an independent oracle)."""
    p = shamir.P
    out = []
    for x in at.tolist():
        total = 0
        for i, (xi, yi) in enumerate(zip(xs.tolist(), ys.tolist())):
            num, den = 1, 1
            for j, xj in enumerate(xs.tolist()):
                if j != i:
                    num, den = num * (x - xj) % p, den * (xi - xj) % p
            total = (total + yi * num * pow(den, -1, p)) % p
        out.append(total)
    return np.array(out, dtype=np.uint64)


@pytest.mark.parametrize("consistency, refusal", [(True, "more than two hops from me"),
                                                  (False, "not my neighbours")])
def test_an_unmask_request_naming_a_device_outside_the_neighbourhood_is_refused(consistency, refusal):
    """Issue 23: a device answers Unmask only about its own neighbourhood (two hops with the
    consistency check, whose signatures need it; its neighbours without). Naming anyone else is
    refused, and the list's strict order already refuses naming one device twice."""
    config = make_config(100, 4, 3, consistency=consistency)
    ball = set(config.two_hop_rows(np.array([1]))[0].tolist())
    stranger = min(set(range(1, 101)) - ball)

    def widen(outgoing):
        message = outgoing.message
        if outgoing.recipient == 1 and isinstance(message, UnmaskRequest):
            survivors = tuple(sorted({*message.survivors, stranger}))
            return dataclasses.replace(outgoing, message=dataclasses.replace(message, survivors=survivors))
        return outgoing

    cohort = ProtocolCohort(config)
    cohort.run(tamper_server=widen)
    assert refusal in str(cohort.refused[1])
    assert not any(isinstance(m, UnmaskResponse) and m.sender == 1 for m in cohort.sent)
