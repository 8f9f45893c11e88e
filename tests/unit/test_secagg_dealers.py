"""No single device can fail a round or push out an honest one (issue 23, findings 2 and 3;
issue 38, problems 1 and 5).

A corrupt dealer (shares on no polynomial, garbage for one neighbour, a consistent polynomial
whose constant is not its committed secret, a good share sealed under a key of its own to frame
its holder) is convicted by its own check or its own proven key and excluded for every device
before any masked input; a holder that complains about a good share is settled by the dealer's
proven key and named; a complaint nobody settled is disputed, nobody's fault; a server that alters
a delivery or forges a complaint gets no key; an Unmask request naming a device outside the
neighbourhood is refused. In process, against the real state machines.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.secagg import ProtocolCohort, identities, lax_client, make_config, random_inputs
from tally.secagg import MalformedMessage, SecAggServer, crypto, shamir, sharecheck
from tally.secagg.adversary import CORRUPT_DEALERS, FramingDealer, InconsistentDealer, WrongSecretDealer
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
    why = "does not open the mask key and seed it committed to" if adversary is WrongSecretDealer else (
        "fails under the share key it proved")
    assert server.excluded.keys() == {dealer} and why in server.excluded[dealer]
    assert server.misbehaving == {} and server.disputed == {}  # no holder framed
    assert server.convicted == {dealer} and result_convicted(server) == (dealer,)
    assert cohort.refused == {} and cohort.rejected == {}  # the neighbour aimed at stays too
    assert not any(isinstance(m, MaskedInputResponse) and m.sender == dealer for m in cohort.sent)
    result = server.results["s"]
    assert set(result.contributors) == set(range(1, n + 1)) - {dealer}
    assert result.total.tolist() == cohort.exact("s", result.contributors)
    complainers = {m.sender for m in cohort.sent if isinstance(m, ShareComplaints) and m.complaints}
    neighbours = set(cohort.config.neighbours(dealer).tolist())
    expected = {InconsistentDealer: neighbours, WrongSecretDealer: set()}.get(adversary, {min(neighbours)})
    assert complainers == expected


@pytest.mark.parametrize("check, adversary", [("passes", InconsistentDealer), ("constant_opens", WrongSecretDealer)],
                         ids=["no share check", "no constant check"])
def test_without_the_check_a_corrupt_dealer_fails_the_round_after_every_input(monkeypatch, check, adversary):
    """The controls: what issue 23 finding 2 and issue 38 problem 1 were. Every holder accepts
    its share, every device sends its masked input, and Unmask cannot rebuild the dealer's seed."""
    monkeypatch.setattr(sharecheck, check, lambda *args: True)
    cohort = ProtocolCohort(make_config(12, 11, 7), dealers={5: adversary})
    cohort.run()
    assert cohort.server.excluded == {}
    assert sum(isinstance(m, MaskedInputResponse) for m in cohort.sent) == 12
    assert cohort.server.aborted is not None and cohort.server.results == {}
    assert "do not rebuild the secrets they committed to" in cohort.server.aborted.reason


def test_the_framing_dealer_of_problem_5_is_named_and_its_holder_is_not():
    """Issue 38 problem 5: the dealer seals its lowest neighbour's good share under a key of its
    own. The holder complains; the dealer can prove only the pair's real shared secret, under
    which the ciphertext does not open: the dealer is excluded, the holder is nobody's suspect."""
    config = make_config(12, 11, 7, consistency=True)
    cohort = ProtocolCohort(config, dealers={5: FramingDealer})
    cohort.run()
    server = cohort.server
    framed = min(config.neighbours(5).tolist())
    assert server.excluded == {5: f"its share for device {framed} fails under the share key it proved"}
    assert framed not in server.misbehaving and server.misbehaving == {}
    assert framed in server.results["s"].contributors


def test_a_complaint_the_dealer_leaves_unanswered_stays_disputed_and_names_no_holder():
    config = make_config(12, 11, 7)
    cohort = ProtocolCohort(config, dealers={5: InconsistentDealer})

    def leave(outgoing):  # the accused dealer is gone before it can answer
        if isinstance(outgoing.message, JustifyRequest):
            cohort.refused[outgoing.recipient] = ConnectionError("gone")
        return outgoing

    cohort.run(tamper_server=leave)
    server = cohort.server
    assert server.excluded == {5: "did not answer complaints about its shares"}
    assert server.misbehaving == {}
    assert {dealer for dealer, _ in server.disputed} == {5} and len(server.disputed) == 11
    assert server.convicted == set() and result_convicted(server) == ()  # gone is not proven


def result_convicted(server: SecAggServer) -> tuple[int, ...]:
    """What the coordinator is told is proven (it bans those devices from the job)."""
    return server.results["s"].convicted


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
    assert server.misbehaving == {liar: f"complained about a good share from device {dealer}, proven by its share key"}
    assert server.disputed == {}
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
    holder.secrets["s"].complained[4] = (b"x" * 10, b"y" * sharecheck.check_bytes_for(3))
    holder._phase = _AwaitShareVerdict(holder, frozenset({2, 3, 4, 5, 6}))
    with pytest.raises(MalformedMessage, match="not settled"):
        holder.receive(ShareVerdict(config.ref, (), ()))
    with pytest.raises(MalformedMessage, match="did not deal me shares"):
        holder.receive(ShareVerdict(config.ref, (1, 4), ()))
    with pytest.raises(MalformedMessage, match="once each, ascending"):
        holder.receive(ShareVerdict(config.ref, (4, 4), ()))


def _dealer_polynomials(t: int, holders: int, key: int, seed: int, offsets: tuple[int, int] = (0, 0)):
    """A dealer's polynomials for secrets (key, seed) + offsets, its blinding, its shares' rows
    and a digest over them."""
    *secret_polynomials, blinding = shamir.polynomials([key + offsets[0], seed + offsets[1], crypto.random_scalar()], t)
    xs = list(range(1, holders + 1))
    rows = [list(row) for row in zip(*shamir.evaluate([*secret_polynomials, blinding], xs))]
    digest = sharecheck.digest(SessionRef("j", 1, "s"), "s", 1, [crypto.scalar_bytes(r[0]) for r in rows])
    return secret_polynomials, blinding, rows, digest


def _plaintext(row: list[int]) -> bytes:
    return b"".join(crypto.scalar_bytes(v % shamir.P) for v in row)


@settings(max_examples=40, deadline=None)
@given(t=st.integers(2, 12), extra=st.integers(1, 8), data=st.data())
def test_shares_on_no_polynomial_fail_some_holder_whatever_check_the_dealer_publishes(t, extra, data):
    """Soundness of the holders' half: the dealer fits h to the first t holders as best it can
    (any h must agree with t of them); once a share lies off the polynomial, a holder fails."""
    holders = t + extra
    secret_polynomials, blinding, rows, digest = _dealer_polynomials(t, holders, crypto.random_scalar(),
                                                                      crypto.random_scalar())
    off = data.draw(st.lists(st.integers(0, holders - 1), min_size=1, unique=True))
    delta = data.draw(st.integers(1, shamir.P - 1))
    term = data.draw(st.integers(0, 2))
    for i in off:
        rows[i][term] = (rows[i][term] + delta) % shamir.P
    blind = crypto.commit(blinding[0])
    c = [value for value, _ in sharecheck.challenge(digest, blind)]
    combined = [(r[2] + c[0] * r[0] + c[1] * r[1]) % shamir.P for r in rows]
    fitted = _interpolate(list(range(1, t + 1)), combined[:t], t)
    message = blind + b"".join(crypto.scalar_bytes(v) for v in fitted)
    verdicts = [sharecheck.passes(_plaintext(rows[i]), digest + message, i + 1) for i in range(holders)]
    assert all(verdicts[:t])  # fitted through them
    errors = [delta if i in off else 0 for i in range(holders)]
    # The shares moved by errors that themselves lie on a polynomial of degree < t (every share
    # alike, or any such pattern) are still a consistent sharing: the check rightly passes them.
    fitted_errors = _interpolate(list(range(1, t + 1)), errors[:t], t)
    on_polynomial = all(sum(c * x**k for k, c in enumerate(fitted_errors)) % shamir.P == e
                        for x, e in zip(range(1, holders + 1), errors))
    assert on_polynomial or not all(verdicts)
    honest = sharecheck.check_message(secret_polynomials, blinding, digest)
    clean = set(range(holders)) - set(off)
    assert all(sharecheck.passes(_plaintext(rows[i]), digest + honest, i + 1) for i in clean)


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 8), which=st.sampled_from([(1, 0), (0, 1), (1, 1)]), offset=st.integers(1, shamir.P - 1),
       blind_offset=st.integers(0, 3), private=st.binary(min_size=32, max_size=32))
def test_a_consistent_sharing_of_a_wrong_constant_never_opens_the_commitments(t, which, offset, blind_offset, private):
    """Soundness of the constant-term half (issue 38 problem 1): a dealer whose polynomials are
    consistent (every holder passes) but whose constant is not its committed mask key or seed,
    up to sign, is caught whatever it publishes as G; the honest dealing and the negated
    secrets (which rebuild the same X25519 secret and self mask) open."""
    key, seed = crypto.mask_scalar(private), crypto.random_scalar()
    mask_public, seed_commitment = crypto.KeyPair(private).public, crypto.public_of_scalar(seed)
    offsets = (which[0] * offset, which[1] * offset)
    wrong = (offsets[0] + key) % shamir.P in (key, shamir.P - key) and (offsets[1] + seed) % shamir.P in (
        seed, shamir.P - seed)
    for dealt_offsets, should_open in ((offsets, wrong), ((0, 0), True), ((-2 * key, -2 * seed), True)):
        polynomials, blinding, rows, digest = _dealer_polynomials(t, t + 2, key, seed, dealt_offsets)
        message = sharecheck.check_message(polynomials, blinding, digest)
        assert all(sharecheck.passes(_plaintext(r), digest + message, i + 1) for i, r in enumerate(rows))
        if blind_offset and not should_open:  # a G moved by a known amount, fixed before the challenge
            moved = crypto.commit(blinding[0] + blind_offset)
            message = sharecheck.check_message(polynomials, [blinding[0] + blind_offset, *blinding[1:]], digest)
            assert message[:32] == moved
        assert sharecheck.constant_opens(message, digest, mask_public, seed_commitment) is should_open


def _interpolate(xs: list[int], ys: list[int], t: int) -> list[int]:
    """Coefficients (constant first) of the polynomial of degree < t through (xs, ys) mod l, by
    Lagrange in Python integers (an oracle independent of ``shamir``)."""
    p = shamir.P
    coefficients = [0] * t
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        basis, den = [1], 1
        for j, xj in enumerate(xs):
            if j != i:
                basis = [(a - xj * b) % p for a, b in zip([0, *basis], [*basis, 0])]
                den = den * (xi - xj) % p
        scale = yi * pow(den, -1, p) % p
        coefficients = [(c + scale * b) % p for c, b in zip(coefficients, basis)]
    return coefficients


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
