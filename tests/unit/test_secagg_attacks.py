"""The adversarial review's attacks on the secure-sum engine (issue 12), in process.

Each test plays a malicious aggregator (it rewrites what the real ``SecAggServer`` sends) or a
malicious device (it rewrites what one real ``SecAggClient`` sends), and checks that the
attack yields nothing: the victim refuses, or the honest devices' sum comes out exact.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import numpy as np
import pytest

from support.secagg import (
    ProtocolCohort,
    identities,
    lax_client,
    make_config,
    roster,
    share_pairs,
    with_shares,
)
from support.split_view import SplitViewServer
from tally.codec import Field, Kind, PayloadSchema, ring_mask, to_ring
from tally.secagg import (
    DevicePolicy,
    MalformedMessage,
    SecAggClient,
    SecAggServer,
    SessionConfig,
    SessionRef,
    SigningKey,
    ThreatModel,
    UnsafeSession,
    crypto,
    shamir,
)
from tally.secagg.layouts import (
    advertise_statement,
    consistency_message,
    share_associated_data,
)
from tally.secagg.messages import (
    AdvertiseKeys,
    MaskedInputResponse,
    NeighbourKeys,
    Outgoing,
    ShareDelivery,
    ShareKeysRequest,
    ShareKeysResponse,
    SumPublicKeys,
    UnmaskRequest,
    UnmaskResponse,
)
from tally.secagg.params import GraphParams

# ---- 1. key substitution -----------------------------------------------------------------------


def _substitute_keys(config: SessionConfig, relay_real_signature: bool):
    """A malicious aggregator's ShareKeysRequest rewrite for device 1: every neighbour's keys
    replaced by key pairs the aggregator holds. Returns the hook and those key pairs."""
    attacker_identity = SigningKey.generate()
    pairs: dict[int, tuple[crypto.KeyPair, crypto.KeyPair]] = {}

    def substitute(o: Outgoing) -> Outgoing:
        if o.recipient != 1 or not isinstance(o.message, ShareKeysRequest):
            return o
        forged = []
        for nb in o.message.neighbours:
            cipher, mask = pairs.setdefault(nb.index, (crypto.KeyPair(os.urandom(32)), crypto.KeyPair(os.urandom(32))))
            keys = tuple(SumPublicKeys(k.sum_id, cipher.public, mask.public, bytes(32)) for k in nb.keys)
            signature = nb.signature if relay_real_signature else attacker_identity.sign(
                advertise_statement(config.ref, nb.index, keys)
            )
            forged.append(NeighbourKeys(nb.index, keys, signature))
        return Outgoing(1, ShareKeysRequest(o.message.ref, tuple(forged)))

    return substitute, pairs


def _secrets_the_attacker_decrypts(config, cohort, pairs) -> dict[str, tuple[bytes, bytes]]:
    """What the aggregator rebuilds of device 1's (mask key, seed) per sum from the shares
    device 1 encrypted to the substituted keys."""
    advert = next(m for m in cohort.sent if isinstance(m, AdvertiseKeys) and m.sender == 1)
    response = next((m for m in cohort.sent if isinstance(m, ShareKeysResponse) and m.sender == 1), None)
    if response is None:
        return {}
    out = {}
    for position, spec in enumerate(config.sums):
        context = config.ref.context(spec.sum_id)
        victim_cipher = advert.keys[position].cipher_public
        holders, rows = [], []
        for share in response.shares:
            if share.sum_id != spec.sum_id:
                continue
            secret = pairs[share.recipient][0].agree(victim_cipher)
            key = crypto.share_key(secret, context, 1, share.recipient)
            ad = share_associated_data(config.ref, spec.sum_id, 1, share.recipient)
            plaintext = crypto.open_sealed(key, share.ciphertext, ad)
            size = shamir.SHARE_BYTES
            rows.append([shamir.share_from_bytes(plaintext[i : i + size]) for i in (0, size)])
            holders.append(share.recipient)
        t = config.threshold
        mask_key, seed = shamir.reconstruct([holders[:t]] * 2, [[r[0] for r in rows[:t]], [r[1] for r in rows[:t]]])
        out[spec.sum_id] = (mask_key, seed)
    return out


@pytest.mark.parametrize("consistency", [False, True])
@pytest.mark.parametrize("relay_real_signature", [False, True])
def test_an_aggregator_substituting_keys_gets_nothing_and_the_victim_refuses(
    consistency, relay_real_signature, monkeypatch
):
    """The aggregator hands device 1 keys it made itself in place of its neighbours' (signed
    with a key of its own, or with the neighbours' real signatures relayed): device 1 checks
    them against the roster, refuses, and sends no share and no masked input. With the check
    switched off the same attack rebuilds device 1's mask key and seed, so the test can fail."""
    config = make_config(10, 9, 6, consistency=consistency)
    substitute, pairs = _substitute_keys(config, relay_real_signature)
    cohort = ProtocolCohort(config)
    cohort.run(tamper_server=substitute)
    assert "not signed by its enrolled identity key" in str(cohort.refused[1])
    assert [type(m) for m in cohort.sent if getattr(m, "sender", None) == 1] == [AdvertiseKeys]
    assert _secrets_the_attacker_decrypts(config, cohort, pairs) == {}

    monkeypatch.setattr("tally.secagg.client._check_neighbour", lambda config, neighbour: None)
    substitute, pairs = _substitute_keys(config, relay_real_signature)
    unchecked = ProtocolCohort(config)
    unchecked.run(tamper_server=substitute)
    stolen = _secrets_the_attacker_decrypts(config, unchecked, pairs)
    advert = next(m for m in unchecked.sent if isinstance(m, AdvertiseKeys) and m.sender == 1)
    mask_key, seed = stolen["s"]
    assert crypto.public_of_scalar(mask_key) == advert.keys[0].mask_public
    assert crypto.public_of_scalar(seed) == advert.keys[0].seed_commitment


def test_keys_are_bound_to_their_sender_index_and_session():
    """A device's genuine, signed keys replayed for another index or another session fail."""
    config = make_config(6, 5, 4)
    client = lax_client(config, 2)
    (advert,) = client.start()
    statement = advertise_statement(config.ref, 2, advert.keys)
    public = identities(6)[2].public
    assert crypto.verify_signature(public, advert.signature, statement)
    assert not crypto.verify_signature(public, advert.signature, advertise_statement(config.ref, 3, advert.keys))
    other = dataclasses.replace(config.ref, session_id="another")
    assert not crypto.verify_signature(public, advert.signature, advertise_statement(other, 2, advert.keys))
    server = SecAggServer(config)
    with pytest.raises(MalformedMessage, match="not signed by its enrolled identity key"):
        server.receive(AdvertiseKeys(config.ref, 3, advert.keys, advert.signature))


# ---- 3. one device cannot stop the others' sum -------------------------------------------------

# Encodings of X25519 points of small order (zero, one, the order-8 points, and p, p+1).
SMALL_ORDER = [
    bytes(32),
    (1).to_bytes(32, "little"),
    bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),
    bytes.fromhex("5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157"),
    ((1 << 255) - 19).to_bytes(32, "little"),
    ((1 << 255) - 18).to_bytes(32, "little"),
]


@pytest.mark.parametrize("bad", SMALL_ORDER)
def test_a_small_order_key_excludes_only_its_sender(bad):
    """Device 3 advertises a key of small order, correctly signed with its own identity: the
    server refuses it at AdvertiseKeys and the other nine devices' sum is exact."""
    config = make_config(10, 9, 6)
    cohort = ProtocolCohort(config, seed=3)

    def poison(message):
        if isinstance(message, AdvertiseKeys) and message.sender == 3:
            keys = tuple(dataclasses.replace(k, mask_public=bad) for k in message.keys)
            return AdvertiseKeys(message.ref, 3, keys, identities(10)[3].sign(
                advertise_statement(config.ref, 3, keys)))
        return message

    cohort.run(tamper_client=poison)
    assert "small order" in str(cohort.rejected[3])
    assert cohort.server.aborted is None and cohort.refused.keys() <= {3}
    result = cohort.server.results["s"]
    assert 3 not in result.contributors and len(result.contributors) == 9
    assert result.total.tolist() == cohort.exact("s", result.contributors)


def _wrong_shares(kind: str) -> Callable[[UnmaskResponse], UnmaskResponse]:
    def corrupt(share: bytes) -> bytes:
        if kind == "zero":
            return bytes(len(share))
        # A crafted offset: a valid scalar one away, so only the commitment check can tell.
        return shamir.share_to_bytes((shamir.share_from_bytes(share) + 1) % shamir.P)

    def rewrite(m: UnmaskResponse) -> UnmaskResponse:
        return with_shares(m, seeds=[(o, corrupt(s)) for o, s in share_pairs(m.seed_owners, m.seed_shares)],
                           keys=[(o, corrupt(s)) for o, s in share_pairs(m.key_owners, m.key_shares)])

    return rewrite


@pytest.mark.parametrize("kind", ["zero", "offset"])
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("graph", [(10, 9, 6), (12, 6, 3)])
def test_wrong_shares_from_one_device_are_decoded_around_and_the_sum_is_exact(kind, dropout, graph):
    """Device 2 answers Unmask with wrong shares of every secret it holds (zeroed, or off by one
    in a chunk so that the range check alone cannot see it): every secret is checked against
    its commitment, decoded from the other holders' shares, and device 2 is named. In the sparse
    graph some secrets are decoded (naming device 2) while others wait for another share: the
    next rebuild takes those from holders never caught lying first."""
    config = make_config(*graph)
    cohort = ProtocolCohort(config, seed=7)
    rewrite = _wrong_shares(kind)
    lost = {5} if dropout else set()

    def tamper(message):
        if isinstance(message, UnmaskResponse) and message.sender == 2:
            return rewrite(message)
        if isinstance(message, MaskedInputResponse) and message.sender in lost:
            return dataclasses.replace(message, data=b"")  # never arrives: rejected as malformed
        return message

    cohort.run(tamper_client=tamper)
    assert cohort.server.aborted is None, cohort.server.aborted
    result = cohort.server.results["s"]
    assert set(result.contributors) == set(range(1, config.n + 1)) - lost
    assert result.total.tolist() == cohort.exact("s", result.contributors)
    assert "wrong" in cohort.server.misbehaving[2]


def test_answers_in_any_order_rebuild_seeds_and_keys_exactly():
    """Devices may list their shares in any order: the server places each share by its owner,
    not by its position, for the survivors' seeds and the dropped device's key alike."""
    config = make_config(10, 9, 6)
    cohort = ProtocolCohort(config, seed=8)

    def tamper(message):
        if isinstance(message, UnmaskResponse):
            assert message.key_owners or message.sender not in config.neighbours(5)
            return with_shares(message, seeds=share_pairs(message.seed_owners, message.seed_shares)[::-1],
                               keys=share_pairs(message.key_owners, message.key_shares)[::-1])
        if isinstance(message, MaskedInputResponse) and message.sender == 5:
            return dataclasses.replace(message, data=b"")  # never arrives: rejected as malformed
        return message

    cohort.run(tamper_client=tamper)
    assert cohort.server.aborted is None, cohort.server.aborted
    result = cohort.server.results["s"]
    assert set(result.contributors) == set(range(1, 11)) - {5}
    assert result.total.tolist() == cohort.exact("s", result.contributors)
    assert not cohort.server.misbehaving


def test_too_many_wrong_shares_abort_instead_of_a_wrong_sum():
    """When wrong shares outnumber what the others' shares can correct, the session aborts
    naming the secrets: it never completes with every coordinate wrong."""
    config = make_config(8, 7, 6)
    cohort = ProtocolCohort(config, seed=9)
    rewrite = _wrong_shares("offset")
    cohort.run(tamper_client=lambda m: rewrite(m) if isinstance(m, UnmaskResponse) and m.sender in (2, 3) else m)
    assert cohort.server.aborted is not None and "do not rebuild" in cohort.server.aborted.reason
    assert cohort.server.results == {}


# ---- 8. a device never masks without t delivered shares ----------------------------------------


@pytest.mark.parametrize("delivered", [0, 3, 5])
def test_a_device_refuses_to_mask_when_fewer_than_t_shares_are_delivered(delivered):
    """The aggregator withholds device 1's ShareDelivery (t=6): it would otherwise mask with
    its self mask and few pairwise masks, and its seed would later be released. It refuses."""
    config = make_config(10, 9, 6)
    cohort = ProtocolCohort(config, seed=1)

    def withhold(o: Outgoing) -> Outgoing:
        if o.recipient == 1 and isinstance(o.message, ShareDelivery):
            return Outgoing(1, ShareDelivery(o.message.ref, o.message.shares[:delivered]))
        return o

    cohort.run(tamper_server=withhold)
    assert "refusing to send my input" in str(cohort.refused[1])
    assert not any(isinstance(m, MaskedInputResponse) and m.sender == 1 for m in cohort.sent)
    result = cohort.server.results.get("s")
    if result is not None:  # the others may still sum, without device 1
        assert 1 not in result.contributors


# ---- 5. device-side policy -------------------------------------------------------------------


def test_a_device_refuses_unsafe_and_plain_configurations():
    keys = identities(10)
    safe = make_config(10, 9, 6, consistency=True)
    SecAggClient(safe, 1, keys[1])  # the default policy accepts a safe full graph
    # Without the consistency check only a device that declares the server semi-honest joins.
    unchecked = dataclasses.replace(safe, consistency_check=False)
    with pytest.raises(UnsafeSession, match="skips the consistency check"):
        SecAggClient(unchecked, 1, keys[1])
    semi_honest = DevicePolicy(threat=ThreatModel(dropout_rate=0.0, malicious_server=False))
    SecAggClient(unchecked, 1, keys[1], policy=semi_honest)
    with pytest.raises(UnsafeSession, match="t=2 too low"):
        SecAggClient(dataclasses.replace(safe, params=GraphParams(10, 9, 2)), 1, keys[1])
    plain = dataclasses.replace(safe, plain=True, consistency_check=False)
    with pytest.raises(UnsafeSession, match="did not opt in to plain"):
        SecAggClient(plain, 1, keys[1])
    SecAggClient(plain, 1, keys[1], policy=DevicePolicy(allow_plain=True))  # benchmarks opt in
    with pytest.raises(UnsafeSession, match="does not list this device's identity key"):
        SecAggClient(safe, 1, keys[2])
    with pytest.raises(UnsafeSession, match="below this device's floor"):
        SecAggClient(safe, 1, keys[1], policy=DevicePolicy(min_cohort=20))
    # A stricter device (40 % corrupt) refuses what a default one accepts.
    strict = DevicePolicy(threat=ThreatModel(dropout_rate=0.0, corrupt_rate=0.4))
    with pytest.raises(UnsafeSession, match="too low"):
        SecAggClient(safe, 1, keys[1], policy=strict)


# ---- 6. ConsistencyCheck counts signers, not signatures ----------------------------------------


@pytest.mark.parametrize("forgery", ["repeated", "non_survivor", "foreign_key"])
def test_consistency_check_needs_t_distinct_surviving_signers(forgery):
    config = make_config(10, 9, 6, consistency=True)
    cohort = ProtocolCohort(config, seed=4)
    dropped = 10

    def forge(o: Outgoing) -> Outgoing:
        if o.recipient != 1 or not isinstance(o.message, UnmaskRequest):
            return o
        sigs = o.message.signatures
        if forgery == "repeated":  # one survivor's signature t times
            sigs = (sigs[1],) * config.threshold
        elif forgery == "non_survivor":  # t-1 survivors plus a device outside the signed set
            statement = _statement(config, o.message, dropped)
            sigs = sigs[: config.threshold - 1] + ((dropped, identities(10)[dropped].sign(statement)),)
        else:  # the aggregator signs for t survivors with keys of its own
            sigs = tuple((j, SigningKey.generate().sign(_statement(config, o.message, j)))
                         for j, _ in sigs[: config.threshold])
        return Outgoing(1, dataclasses.replace(o.message, signatures=sigs))

    cohort.run(
        tamper_server=forge,
        tamper_client=lambda m: dataclasses.replace(m, data=b"")
        if isinstance(m, MaskedInputResponse) and m.sender == dropped else m,
    )
    assert "distinct surviving neighbours signed" in str(cohort.refused[1])
    assert not any(isinstance(m, UnmaskResponse) and m.sender == 1 for m in cohort.sent)


def _statement(config: SessionConfig, request: UnmaskRequest, signer: int) -> bytes:
    """What ``signer`` would sign of the survivors the request names: its own view of them."""
    closed = set(config.neighbours(signer).tolist()) | {signer}
    view = [i for i in request.survivors if i in closed]
    return consistency_message(config.ref, request.sum_id, signer, view)


# ---- 11. out-of-range inputs -------------------------------------------------------------------


def test_a_total_no_honest_cohort_can_reach_is_refused():
    schema = PayloadSchema((Field("w", (3,), clip=1.0, frac_bits=8),
                            Field("examples", (1,), kind=Kind.COUNT, clip=100)))
    n, bits = 8, schema.required_bits(8)
    rng = np.random.default_rng(0)
    honest = [to_ring(schema.encode({"w": rng.uniform(-1, 1, 3), "examples": [100]}, rng).vector, bits)
              for _ in range(n - 1)]
    total = sum(v.astype(np.uint64) for v in honest) & np.uint64(ring_mask(bits))
    assert schema.decode_sum(total, bits, contributors=n)["examples"][0] == 700
    forged = to_ring(np.array([0, 0, 0, -1_000], dtype=np.int64), bits)
    with pytest.raises(Exception, match=r"field 'examples': 1 totals outside \[0, 800\]"):
        schema.decode_sum((total + forged) & np.uint64(ring_mask(bits)), bits, contributors=n)
    # Within the ring but beyond what n devices clipped at 1.0 can sum to.
    w0 = int(schema.decode_sum(total, bits)["w"][0] * 256)
    beyond = n * schema.max_abs("w") + 1
    assert beyond < 2 ** (bits - 1)
    far = to_ring(np.array([beyond - w0, 0, 0, 0], dtype=np.int64), bits)
    with pytest.raises(Exception, match="field 'w'"):
        schema.decode_sum((total + far) & np.uint64(ring_mask(bits)), bits, contributors=n)


def test_seed_commitments_bind_the_seed_up_to_sign():
    """The seed's commitment is u(seed * B): different seeds commit differently, a seed and its
    negative alike, and both give one self mask (the seed is used as its unsigned form)."""
    seed = crypto.random_scalar()
    assert crypto.public_of_scalar(seed) != crypto.public_of_scalar(seed + 1)
    assert crypto.public_of_scalar(seed) == crypto.public_of_scalar(crypto.GROUP_ORDER - seed)
    context = make_config(4, 3, 3).ref.context("s")
    assert crypto.self_mask_key(seed, context) == crypto.self_mask_key(crypto.GROUP_ORDER - seed, context)
    assert crypto.self_mask_key(seed, context) != crypto.self_mask_key(seed + 1, context)


def test_a_rebuilt_mask_key_agrees_as_its_x25519_key_whatever_its_sign_or_form():
    """The server removes a dropout's pairwise masks with the scalar it rebuilt: an honest key
    rebuilt as +-scalar agrees exactly as the device's X25519 key did; a key with no clamped form
    (a corrupt device made its public key as u(r B) for any r) agrees through the Edwards curve
    as its neighbours' X25519 did with it."""
    private, peer = os.urandom(32), crypto.KeyPair(os.urandom(32))
    scalar = crypto.mask_scalar(private)
    for rebuilt in (scalar, crypto.GROUP_ORDER - scalar):
        assert crypto.ScalarKey(rebuilt).agree(peer.public) == crypto.KeyPair(private).agree(peer.public)
    unclamped = 8 * 12345  # +-r / 8 mod l is no j in [2^251, 2^252): no clamped key is +-r mod l
    assert crypto.ScalarKey(unclamped).agree(peer.public) == peer.agree(crypto.public_of_scalar(unclamped))


# ---- 12. survivor split: each device shown its own survivor set (third review, finding 1) -----


def _split_cohort(n: int, consistency: bool) -> tuple[ProtocolCohort, SplitViewServer]:
    """A cohort of n with the parameters a real job gets (Harary from n = 100 on) and a malicious
    aggregator splitting views against device 1. Without the check, devices run the semi-honest
    policy, the only one that accepts such a session."""
    config = SessionConfig.plan(SessionRef("job", 1, f"split-{n}"), [("s", PayloadSchema((
        Field("w", (4,), clip=1.0, frac_bits=8),)))], n, consistency_check=consistency, identities=roster(n))
    threat = ThreatModel(dropout_rate=0.1, malicious_server=consistency)
    server = SplitViewServer(config, victim=1, attempts=[])
    return ProtocolCohort(config, seed=n, policy=DevicePolicy(threat=threat), server=server), server


@pytest.mark.parametrize("n", [20, 100, pytest.param(1000, marks=pytest.mark.full)])
def test_a_survivor_split_reads_one_input_without_the_consistency_check(n):
    """The attack is real: against devices that skip the check (a semi-honest policy, which the
    default policy refuses) the aggregator alone gets device 1's exact input."""
    cohort, server = _split_cohort(n, consistency=False)
    cohort.run()
    attempt = server.attempt
    assert len(attempt.masked_with) == cohort.config.threshold
    assert attempt.recovered is not None, attempt.why_not
    assert np.array_equal(attempt.recovered, cohort.inputs[1]["s"])


@pytest.mark.parametrize("n", [20, 100, pytest.param(1000, marks=pytest.mark.full)])
def test_a_survivor_split_fails_against_the_consistency_check(n):
    """With the check (the default), every device signs the view it was shown and answers only
    once t neighbours signed views that count it as a survivor: split views cannot gather both
    the victim's seed and its partners' keys, on the full graph (n = 20) as on sparse Harary
    graphs (n = 100: k = 26, t = 16; n = 1,000: k = 78, t = 52)."""
    cohort, server = _split_cohort(n, consistency=True)
    params = cohort.config.params
    assert (params.k, params.t) == {20: (19, 11), 100: (26, 16), 1000: (78, 52)}[n]
    cohort.run()
    attempt = server.attempt
    assert len(attempt.masked_with) == cohort.config.threshold
    assert attempt.recovered is None
    assert "shares" in attempt.why_not
    refusals = [str(e) for e in cohort.refused.values()]
    assert any("signed views that count me as a survivor" in r for r in refusals), refusals[:3]
