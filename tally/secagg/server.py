"""Server half of the secure sum: a sans-IO state machine, one small class per phase.

Feed it device messages (``receive``) and deadline events (``on_deadline``); it returns
the messages to send. It never sees a device's input in the clear: it holds masked
vectors and, per sum, reconstructs either a device's self-mask seed (it survived) or
its mask key (it dropped), never both.

One misbehaving device must not stop the others' sum: keys of small order and keys not signed
by the sender's enrolled identity are refused at AdvertiseKeys (the sender is left out, the
session goes on). Before any input is masked, every dealer's shares are checked to be shares of
exactly the secrets it committed to (``tally.secagg.sharecheck``): the holders check their shares
against the dealer's check polynomial, this server checks its constant term against the signed
commitments, and a dealer that fails either is excluded. A complaint stays ``disputed`` until the
dealer's proven share key settles it (``crypto.prove_shared_secret``): then either the dealer is
excluded or the holder is recorded in ``misbehaving``, never on anyone's word. Every rebuilt
secret is still checked against its commitment; a wrong share is decoded around with the extra
shares of the other holders, and its sender is recorded in ``misbehaving``.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Any, Generic, TypeVar, cast

import numpy as np

from tally.codec.packing import PackedSum
from tally.secagg import crypto, shamir, sharecheck
from tally.secagg.config import SessionConfig
from tally.secagg.errors import (
    DuplicateMessage,
    MalformedMessage,
    OutOfPhase,
    SessionAbortedError,
    StaleMessage,
    UnknownSender,
)
from tally.secagg.layouts import (
    COMMITMENT_BYTES,
    SHARE_CIPHERTEXT_BYTES,
    advertise_statement,
    consistency_message,
    device_list,
    share_associated_data,
)
from tally.secagg.messages import (
    Abort,
    AdvertiseKeys,
    ClientMessage,
    ConsistencyCheckRequest,
    ConsistencyCheckResponse,
    EncryptedShare,
    JustifyRequest,
    JustifyResponse,
    MaskedInputRequest,
    MaskedInputResponse,
    NeighbourKeys,
    Outgoing,
    RevealedShareKey,
    SessionAborted,
    ShareComplaint,
    ShareComplaints,
    ShareDelivery,
    ShareKeysRequest,
    ShareKeysResponse,
    ShareVerdict,
    SumResult,
    UnmaskRequest,
    UnmaskResponse,
)
from tally.secagg.phases import Phase
from tally.secagg.unmask import (
    SHARE,
    NeededSecrets,
    SecretRebuilder,
    ShareBook,
    indicator,
    remove_masks,
)


class SecAggServer:
    """One session: AdvertiseKeys -> ShareKeys -> per sum (MaskedInput ->
    [ConsistencyCheck] -> Unmask).

    A plain session (``config.plain``, benchmarks only) is just one plain-sum phase per
    sum; it starts when the caller calls ``start()``.
    """

    def __init__(self, config: SessionConfig) -> None:
        self.config = config
        self.results: dict[str, SumResult] = {}
        self.aborted: SessionAborted | None = None
        # What this server reconstructed, per sum: the privacy tests read it.
        self.revealed_seeds: dict[str, frozenset[int]] = {}
        self.revealed_keys: dict[str, frozenset[int]] = {}
        self.advertised: dict[int, AdvertiseKeys] = {}
        self.sharers: frozenset[int] = frozenset()
        # Devices whose connection is known to be gone: no phase waits for them.
        self.lost: set[int] = set()
        # Devices caught sending wrong shares, and what they did: their shares are not trusted.
        self.misbehaving: dict[int, str] = {}
        # Dealers excluded before any masked input, and why: for every device, they never shared.
        self.excluded: dict[int, str] = {}
        # The excluded dealers whose misbehaviour is proven (not merely gone before answering).
        self.convicted: set[int] = set()
        # Complaints no proof has settled yet, (dealer, holder) -> what was claimed: nobody's
        # fault until a justification proves who lied.
        self.disputed: dict[tuple[int, int], str] = {}
        # Each holder's delivery, kept until the verdict to judge complaints about it.
        self.deliveries: dict[int, ShareDelivery] = {}
        everyone = frozenset(range(1, config.n + 1))
        self._phase: _AnyPhase = (
            _NotStarted(self, everyone) if config.plain else _AdvertiseKeysPhase(self, everyone)
        )

    @property
    def phase(self) -> Phase:
        return self._phase.name

    @property
    def finished(self) -> bool:
        return isinstance(self._phase, _Finished)

    @property
    def awaiting(self) -> frozenset[int]:
        """Devices the current phase still waits for."""
        return frozenset(self._phase.pending)

    def start(self) -> list[Outgoing]:
        """The server's opening messages: in a secure session devices speak first (none);
        a plain session asks every device not known to be lost for its first input."""
        if not isinstance(self._phase, _NotStarted):
            return []
        return self._phase.close()

    def receive(self, message: ClientMessage) -> list[Outgoing]:
        if message.ref != self.config.ref:
            raise StaleMessage(
                f"message for {message.ref} reached session {self.config.ref}"
            )
        if not 1 <= message.sender <= self.config.n:
            raise UnknownSender(f"device {message.sender} is not in this cohort")
        return self._phase.accept(message)

    def device_lost(self, index: int) -> list[Outgoing]:
        """The transport saw device ``index`` go: close the phase now if it waited only for it.

        Without this, a known dropout costs the whole phase deadline.
        """
        if not 1 <= index <= self.config.n:
            raise UnknownSender(f"device {index} is not in this cohort")
        self.lost.add(index)
        self._phase.pending.discard(index)
        if not self.finished and self._phase.complete():
            return self._phase.close()
        return []

    def on_deadline(self) -> list[Outgoing]:
        """The caller's clock says the current phase is over: close it with who answered."""
        return self._phase.expire()

    # -- used by the phases ----------------------------------------------------

    def _advance(self, phase: _AnyPhase, outgoing: list[Outgoing]) -> list[Outgoing]:
        self._phase = phase
        return outgoing

    def _abort(self, reason: str, recipients: Iterable[int]) -> list[Outgoing]:
        self.aborted = SessionAborted(reason)
        self._phase = _Finished(self, frozenset())
        return [Outgoing(i, Abort(self.config.ref, reason)) for i in sorted(recipients)]

    def _require(self, survivors: frozenset[int], phase: str, notify: Iterable[int]) -> list[Outgoing] | None:
        if len(survivors) < self.config.min_survivors:
            return self._abort(
                f"{phase}: {len(survivors)} devices answered, "
                f"at least {self.config.min_survivors} are required",
                notify,
            )
        return None

    def _start_sum(self, position: int, alive: frozenset[int]) -> list[Outgoing]:
        if position == len(self.config.sums):
            return self._advance(_Finished(self, frozenset()), [])
        sum_id = self.config.sums[position].sum_id
        out = [Outgoing(i, MaskedInputRequest(self.config.ref, sum_id)) for i in sorted(alive)]
        phase = _PlainSumPhase if self.config.plain else _MaskedInputPhase
        return self._advance(phase(self, alive, position), out)


M = TypeVar("M", bound=ClientMessage)  # the message a phase takes
K = TypeVar("K", bound=ClientMessage | None)  # what it keeps of each in ``received``


class _Phase(abc.ABC, Generic[M, K]):
    name: Phase
    message_type: type[M] | tuple[type[M], ...] = ()

    def __init__(self, server: SecAggServer, expected: frozenset[int]) -> None:
        self.server = server
        self.expected = expected
        self.received: dict[int, K] = {}
        # Who the phase still waits for: kept incrementally, so a message costs O(1), not O(n).
        self.pending: set[int] = set(expected) - server.lost

    sum_id = ""  # a sum's phases name their sum

    def accept(self, message: ClientMessage) -> list[Outgoing]:
        if not isinstance(message, self.message_type):
            raise OutOfPhase(
                f"{type(message).__name__} received while the session is in {self.name}"
            )
        sum_id = getattr(message, "sum_id", "")
        if sum_id != self.sum_id:
            raise StaleMessage(
                f"{type(message).__name__} for sum {sum_id!r} received while "
                f"sum {self.sum_id!r} is in {self.name}"
            )
        if message.sender in self.received:
            raise DuplicateMessage(f"device {message.sender} already sent {self.name}")
        if message.sender not in self.expected:
            raise OutOfPhase(f"device {message.sender} is not part of {self.name}")
        self.validate(message)
        self.received[message.sender] = self.kept(message)
        self.pending.discard(message.sender)
        self.record(message)
        if self.complete():
            return self.close()
        return []

    def complete(self) -> bool:
        return not self.pending

    def kept(self, message: M) -> K:
        """What ``received`` holds for a validated message: the message, unless the phase has
        taken what it needs from it (and says so with its own ``K`` and ``kept``)."""
        return cast(K, message)

    def record(self, message: M) -> None:
        """Phase-specific bookkeeping of a validated message."""

    @abc.abstractmethod
    def validate(self, message: M) -> None: ...

    @abc.abstractmethod
    def close(self) -> list[Outgoing]: ...

    def expire(self) -> list[Outgoing]:
        """The phase's deadline passed: close it with what arrived; nothing more will."""
        return self.close()


# The server drives whichever phase is current through ``accept``/``close``/``expire``, which
# take any ClientMessage: what a phase takes and keeps is its own business.
_AnyPhase = _Phase[Any, Any]


class _Finished(_Phase[ClientMessage, ClientMessage]):
    name = Phase.FINISHED

    def validate(self, message: ClientMessage) -> None:
        raise OutOfPhase("session is finished")

    def accept(self, message: ClientMessage) -> list[Outgoing]:
        if self.server.aborted is not None:
            raise SessionAbortedError(f"session aborted: {self.server.aborted.reason}")
        raise OutOfPhase(f"session is finished; {type(message).__name__} is too late")

    def close(self) -> list[Outgoing]:
        return []


class _NotStarted(_Phase[ClientMessage, ClientMessage]):
    """A plain session before ``start()``, while devices join: they only speak when asked."""

    name = Phase.JOIN
    message_type = ()

    def validate(self, message: ClientMessage) -> None:
        raise OutOfPhase("session has not started")

    def close(self) -> list[Outgoing]:
        return self.server._start_sum(0, self.expected - self.server.lost)


class _AdvertiseKeysPhase(_Phase[AdvertiseKeys, AdvertiseKeys]):
    name = Phase.ADVERTISE_KEYS
    message_type = AdvertiseKeys

    def validate(self, message: AdvertiseKeys) -> None:
        config = self.server.config
        sender = message.sender
        ids = tuple(k.sum_id for k in message.keys)
        expected_ids = tuple(s.sum_id for s in config.sums)
        if ids != expected_ids:
            raise MalformedMessage(f"device {sender}: keys for sums {ids}, expected {expected_ids}")
        for keys in message.keys:
            if len(keys.seed_commitment) != COMMITMENT_BYTES:
                raise MalformedMessage(f"device {sender}: seed commitment must be {COMMITMENT_BYTES} bytes")
            try:
                crypto.check_public_key(keys.cipher_public)
                crypto.check_public_key(keys.mask_public)
            except crypto.CryptoError as exc:
                raise MalformedMessage(f"device {sender}, sum {keys.sum_id!r}: {exc}") from None
            # The share check relates the commitments as points of the prime-order group.
            if not (crypto.in_group(keys.mask_public) and crypto.in_group(keys.seed_commitment)):
                raise MalformedMessage(
                    f"device {sender}, sum {keys.sum_id!r}: mask key or seed commitment is not a point "
                    "of the prime-order group")
        statement = advertise_statement(config.ref, sender, message.keys)
        if not crypto.verify_signature(config.identity(sender), message.signature, statement):
            raise MalformedMessage(f"device {sender}: keys not signed by its enrolled identity key")

    def close(self) -> list[Outgoing]:
        server = self.server
        u1, excluded = _prune(server.config, frozenset(self.received))
        refused = server._require(u1, self.name, self.received)
        if refused is not None:
            return refused
        server.advertised = {i: self.received[i] for i in u1}
        reason = f"fewer than t={server.config.threshold} neighbours advertised keys"
        out = [Outgoing(i, Abort(server.config.ref, reason)) for i in sorted(excluded)]
        # One NeighbourKeys per device, shared by the k requests that list it.
        keys = {i: NeighbourKeys(i, self.received[i].keys, self.received[i].signature) for i in u1}
        for i in sorted(u1):
            neighbours = tuple(keys[j] for j in server.config.neighbours(i).tolist() if j in keys)
            out.append(Outgoing(i, ShareKeysRequest(server.config.ref, neighbours)))
        return server._advance(_ShareKeysPhase(server, u1), out)


def _prune(config: SessionConfig, advertised: frozenset[int]) -> tuple[frozenset[int], frozenset[int]]:
    """Drop devices with fewer than t advertised neighbours, until none is left.

    Such a device's secrets could never be reconstructed, so its input could never be
    unmasked; removing it can starve a neighbour in turn, hence the fixpoint.
    """
    kept = set(advertised)
    changed = True
    while changed:
        starved = {i for i in kept if len(kept.intersection(config.neighbours(i).tolist())) < config.threshold}
        kept -= starved
        changed = bool(starved)
    return frozenset(kept), advertised - kept


class _ShareKeysPhase(_Phase[ShareKeysResponse, ShareKeysResponse]):
    name = Phase.SHARE_KEYS
    message_type = ShareKeysResponse

    def validate(self, message: ShareKeysResponse) -> None:
        config = self.server.config
        neighbours = {int(j) for j in config.neighbours(message.sender)} & self.expected
        wanted = {(s.sum_id, j) for s in config.sums for j in neighbours}
        got = [(share.sum_id, share.recipient) for share in message.shares]
        if len(got) != len(set(got)) or set(got) != wanted:
            raise MalformedMessage(
                f"device {message.sender} must send one share per sum to each of its "
                f"{len(neighbours)} neighbours"
            )
        for share in message.shares:
            if share.sender != message.sender:
                raise MalformedMessage("share sender does not match message sender")
            if len(share.ciphertext) != SHARE_CIPHERTEXT_BYTES or share.check:
                raise MalformedMessage(
                    f"share ciphertext must be {SHARE_CIPHERTEXT_BYTES} bytes, with no check"
                )
        size = sharecheck.message_bytes(config.threshold)
        if tuple(c.sum_id for c in message.checks) != tuple(s.sum_id for s in config.sums) or any(
                len(c.coefficients) != size for c in message.checks):
            raise MalformedMessage(
                f"device {message.sender} must send one check of {size} bytes per sum, in session order")

    def close(self) -> list[Outgoing]:
        server = self.server
        u2 = frozenset(self.received)
        refused = server._require(u2, self.name, u2)
        if refused is not None:
            return refused
        server.sharers = u2
        server.deliveries = _deliveries(server, {i: self.received[i] for i in sorted(u2)})
        out = [Outgoing(j, server.deliveries[j]) for j in sorted(u2)]
        return server._advance(_ComplaintsPhase(server, u2), out)


def _deliveries(server: SecAggServer, responses: dict[int, ShareKeysResponse]) -> dict[int, ShareDelivery]:
    """Each holder's shares, each with its dealer's ciphertext digest and check. A dealer whose
    check's constant term does not open its signed commitments is excluded here, before any
    holder sees its shares: what it shares is not what it committed to."""
    config = server.config
    inbox: dict[int, list[EncryptedShare]] = {j: [] for j in responses}
    for position, spec in enumerate(config.sums):
        sum_id = spec.sum_id
        for dealer, response in responses.items():
            # Every share of a dealer, delivered or not, is in its digest (ascending recipient).
            dealt = sorted((s for s in response.shares if s.sum_id == sum_id), key=_recipient)
            digest = sharecheck.digest(config.ref, sum_id, dealer, [s.ciphertext for s in dealt])
            message = response.checks[position].coefficients
            keys = server.advertised[dealer].keys[position]
            if dealer not in server.excluded and not sharecheck.constant_opens(
                    message, digest, keys.mask_public, keys.seed_commitment):
                server.excluded[dealer] = (
                    f"its check for sum {sum_id!r} does not open the mask key and seed it committed to "
                    "(h(0) B - G is not +-c_1 S_1 +- c_2 S_2)")
                server.convicted.add(dealer)
            check = digest + message
            for share in dealt:
                if share.recipient in inbox:
                    inbox[share.recipient].append(
                        EncryptedShare(sum_id, dealer, share.recipient, share.ciphertext, check))
    return {j: ShareDelivery(config.ref, tuple(shares)) for j, shares in inbox.items()}


def _recipient(share: EncryptedShare) -> int:
    return share.recipient


class _ComplaintsPhase(_Phase[ShareComplaints, ShareComplaints]):
    """Every holder answers its delivery; a complaint must be signed by its holder over the
    share exactly as delivered (an honest server can check that, and the dealer will)."""

    name = Phase.SHARE_COMPLAINTS
    message_type = ShareComplaints

    def validate(self, message: ShareComplaints) -> None:
        if not message.complaints:  # every honest device's answer: no per-message lookup to build
            return
        server = self.server
        delivered = {(s.sum_id, s.sender): s for s in server.deliveries[message.sender].shares}
        seen = set()
        for complaint in message.complaints:
            share = delivered.get((complaint.sum_id, complaint.dealer))
            if complaint.holder != message.sender or share is None or (complaint.sum_id, complaint.dealer) in seen:
                raise MalformedMessage(
                    f"device {message.sender} complains about a share it was not delivered, or twice")
            seen.add((complaint.sum_id, complaint.dealer))
            statement = sharecheck.complaint_statement(
                server.config.ref, complaint.sum_id, complaint.dealer, complaint.holder, share.ciphertext, share.check)
            if not crypto.verify_signature(server.config.identity(message.sender), complaint.signature, statement):
                raise MalformedMessage(f"device {message.sender}: complaint not signed over the delivered share")

    def close(self) -> list[Outgoing]:
        server = self.server
        answered = frozenset(self.received)
        against: dict[int, list[ShareComplaint]] = {}
        for message in self.received.values():
            for complaint in message.complaints:
                against.setdefault(complaint.dealer, []).append(complaint)
        for holders in against.values():
            for complaint in holders:
                server.disputed[(complaint.dealer, complaint.holder)] = (
                    f"device {complaint.holder} complains about device {complaint.dealer}'s share "
                    f"in sum {complaint.sum_id!r}")
        for dealer in sorted(set(against) - answered):
            server.excluded[dealer] = "left before answering complaints about its shares"
        accused = frozenset(against) & answered
        if not accused:
            return _verdict(server, answered, {})
        justify = _JustifyPhase(server, accused, answered, against)
        out = [Outgoing(j, JustifyRequest(server.config.ref, tuple(against[j]))) for j in sorted(accused)]
        return server._advance(justify, out)


class _JustifyPhase(_Phase[JustifyResponse, JustifyResponse]):
    """Each accused dealer reveals, for every share complained about, the pair's shared secret with
    a proof that it is the one both signed keys give; the server derives the share key from it
    and opens the share it delivered. A dealer that does not answer, cannot prove its secret, or
    whose share fails is excluded; a complaint about a share that opens and passes under the
    proven key names its holder as misbehaving. Either way the dispute is settled by proof."""

    name = Phase.JUSTIFY
    message_type = JustifyResponse

    def __init__(self, server: SecAggServer, accused: frozenset[int], answered: frozenset[int],
                 against: dict[int, list[ShareComplaint]]) -> None:
        super().__init__(server, accused)
        self.answered = answered
        self.against = against
        self.settled: dict[int, list[RevealedShareKey]] = {}

    def validate(self, message: JustifyResponse) -> None:
        wanted = [(c.sum_id, c.holder) for c in self.against[message.sender]]
        got = [(k.sum_id, k.holder) for k in message.keys]
        if got != wanted or any(k.dealer != message.sender or len(k.key) != crypto.DH_PROOF_BYTES
                                for k in message.keys):
            raise MalformedMessage(f"device {message.sender} must reveal one proven key per complaint, in order")

    def record(self, message: JustifyResponse) -> None:
        server = self.server
        for reveal in message.keys:
            server.disputed.pop((reveal.dealer, reveal.holder), None)
            fault = _judge(server, reveal)
            if fault is None:
                server.misbehaving[reveal.holder] = (
                    f"complained about a good share from device {reveal.dealer}, proven by its share key")
                self.settled.setdefault(reveal.holder, []).append(reveal)
            elif fault == reveal.holder:
                server.misbehaving[reveal.holder] = (
                    f"complained about device {reveal.dealer} with a cipher key outside the group")
            else:
                server.excluded.setdefault(
                    reveal.dealer, f"its share for device {reveal.holder} fails under the share key it proved")
                server.convicted.add(reveal.dealer)

    def close(self) -> list[Outgoing]:
        server = self.server
        for dealer in sorted(self.expected - frozenset(self.received)):
            server.excluded[dealer] = "did not answer complaints about its shares"
        return _verdict(server, self.answered, self.settled)


def _judge(server: SecAggServer, reveal: RevealedShareKey) -> int | None:
    """Who a justified complaint proves wrong: None if the share opens and passes under the key
    derived from the dealer's proven secret (the holder lied), else the device at fault."""
    config = server.config
    position = [s.sum_id for s in config.sums].index(reveal.sum_id)
    dealer_key = server.advertised[reveal.dealer].keys[position].cipher_public
    holder_key = server.advertised[reveal.holder].keys[position].cipher_public
    context = sharecheck.proof_context(config.ref, reveal.sum_id, reveal.dealer, reveal.holder)
    shared = crypto.verified_shared_secret(reveal.key, dealer_key, holder_key, context)
    if shared is None:
        # No proof can be made for a holder key off the prime-order group: that is the holder's doing.
        return reveal.dealer if crypto.in_group(holder_key) else reveal.holder
    delivered = {(s.sum_id, s.sender): s for s in server.deliveries[reveal.holder].shares}
    share = delivered[(reveal.sum_id, reveal.dealer)]
    ad = share_associated_data(config.ref, share.sum_id, share.sender, share.recipient)
    key = crypto.share_key(shared, config.ref.context(reveal.sum_id), reveal.dealer, reveal.holder)
    try:
        good = sharecheck.passes(crypto.open_sealed(key, share.ciphertext, ad), share.check, share.recipient)
    except crypto.CryptoError:
        good = False
    return None if good else reveal.dealer


def _verdict(server: SecAggServer, answered: frozenset[int],
             settled: dict[int, list[RevealedShareKey]]) -> list[Outgoing]:
    """Every device learns the excluded dealers among its neighbours, and the keys settling its
    complaints; then the first sum starts without the excluded devices."""
    config = server.config
    excluded = frozenset(server.excluded)
    server.sharers -= excluded
    alive = answered - excluded
    server.deliveries = {}
    refused = server._require(alive, Phase.SHARE_VERDICT, alive)
    if refused is not None:
        return refused
    out = []
    for i in sorted(alive):
        named = tuple(j for j in config.neighbours(i).tolist() if j in excluded)
        keys = tuple(k for k in settled.get(i, ()) if k.dealer not in excluded)
        out.append(Outgoing(i, ShareVerdict(config.ref, named, keys)))
    return out + server._start_sum(0, alive)


class _SumPhase(_Phase[M, K]):
    def __init__(self, server: SecAggServer, expected: frozenset[int], position: int) -> None:
        super().__init__(server, expected)
        self.position = position
        self.sum_id = server.config.sums[position].sum_id


class _MaskedInputPhase(_SumPhase[MaskedInputResponse, None]):
    """Each masked input goes into the running sum as it arrives (small ones a batch at a time),
    while the server would otherwise wait for the slowest device: Unmask then only removes the
    masks, and the server holds at most a small batch of uploads (``PackedSum``: 512 KiB), never
    the cohort's."""

    name = Phase.MASKED_INPUT
    message_type = MaskedInputResponse

    def __init__(self, server: SecAggServer, expected: frozenset[int], position: int) -> None:
        super().__init__(server, expected, position)
        spec = server.config.sums[position]
        self.masked = PackedSum(spec.dim, spec.wire_bits)

    def validate(self, message: MaskedInputResponse) -> None:
        size = self.masked.size
        if len(message.data) != size:
            raise MalformedMessage(
                f"masked input for sum {self.sum_id!r} must be {size} bytes, got {len(message.data)}"
            )

    def kept(self, message: MaskedInputResponse) -> None:
        return None  # its data is in the running sum (or queued for it, as a copy)

    def record(self, message: MaskedInputResponse) -> None:
        self.masked.add(message.data)

    def close(self) -> list[Outgoing]:
        server = self.server
        u3 = frozenset(self.received)
        refused = server._require(u3, f"{self.name}[{self.sum_id}]", self.expected)
        if refused is not None:
            return refused
        ref, sum_id = server.config.ref, self.sum_id
        survivors = tuple(sorted(u3))
        masked = self.masked.total()
        if server.config.consistency_check:
            check = _ConsistencyPhase(server, u3, self.position, masked)
            out = [Outgoing(i, ConsistencyCheckRequest(ref, sum_id, check.views[i])) for i in survivors]
            return server._advance(check, out)
        # A device needs only its own neighbourhood's status: the full list would make every
        # request O(n) and the session O(n^2) bytes.
        unmask = _UnmaskPhase(server, u3, self.position, masked, u3)
        out = [Outgoing(i, UnmaskRequest(ref, sum_id, unmask.status(i))) for i in survivors]
        return server._advance(unmask, out)


class _PlainSumPhase(_MaskedInputPhase):
    """Benchmark-only: the inputs arrive unmasked, so the sum is simply their sum."""

    def close(self) -> list[Outgoing]:
        server = self.server
        u3 = frozenset(self.received)
        refused = server._require(u3, f"plain_sum[{self.sum_id}]", self.expected)
        if refused is not None:
            return refused
        dropped = frozenset(range(1, server.config.n + 1)) - u3
        server.results[self.sum_id] = SumResult(
            self.sum_id, self.masked.total(), tuple(sorted(u3)), tuple(sorted(dropped))
        )
        return server._start_sum(self.position + 1, u3)


class _ConsistencyPhase(_SumPhase[ConsistencyCheckResponse, ConsistencyCheckResponse]):
    """Each survivor signs its view (the survivors among itself and its neighbours); each signer
    then gets the survivors within two hops and its neighbours' signatures, all it needs to check
    that t of them signed views that count it as a survivor. Messages stay O(k), not O(n)."""

    name = Phase.CONSISTENCY_CHECK
    message_type = ConsistencyCheckResponse

    def __init__(self, server: SecAggServer, expected: frozenset[int], position: int, masked: np.ndarray) -> None:
        super().__init__(server, expected, position)
        self.masked = masked
        self._is_survivor = indicator(server.config.n, expected)
        self.views = _views(server.config, sorted(expected), self._is_survivor)

    def validate(self, message: ConsistencyCheckResponse) -> None:
        config = self.server.config
        statement = consistency_message(config.ref, self.sum_id, message.sender, self.views[message.sender])
        if not crypto.verify_signature(config.identity(message.sender), message.signature, statement):
            raise MalformedMessage(f"device {message.sender}: invalid survivor-set signature")

    def close(self) -> list[Outgoing]:
        server = self.server
        config = server.config
        u4 = frozenset(self.received)
        refused = server._require(u4, f"{self.name}[{self.sum_id}]", self.expected)
        if refused is not None:
            return refused
        signers = sorted(u4)
        me = np.asarray(signers, dtype=np.int64)
        signed = indicator(config.n, u4)
        balls = config.two_hop_rows(me)
        neighbours = config.neighbour_rows(me)
        out = []
        for r, i in enumerate(signers):
            ball = balls[r]
            near = neighbours[r]
            request = UnmaskRequest(
                config.ref, self.sum_id, tuple(ball[self._is_survivor[ball]].tolist()),
                tuple((j, self.received[j].signature) for j in near[signed[near]].tolist()),
            )
            out.append(Outgoing(i, request))
        return server._advance(
            _UnmaskPhase(server, u4, self.position, self.masked, self.expected), out
        )


def _views(config: SessionConfig, devices: list[int], is_survivor: np.ndarray) -> dict[int, tuple[int, ...]]:
    """Each device's view: the survivors among itself and its neighbours, ascending."""
    if not devices:
        return {}
    me = np.asarray(devices, dtype=np.int64)
    block = np.concatenate([config.neighbour_rows(me), me[:, None]], axis=1)
    block.sort(axis=1)
    alive = is_survivor[block]
    return {i: tuple(row[keep].tolist()) for i, row, keep in zip(devices, block, alive)}


class _UnmaskPhase(_SumPhase[UnmaskResponse, UnmaskResponse]):
    """Collects t shares of every secret the sum needs and rebuilds them all at once; the secrets,
    shares, rebuilding and unmasking are ``tally.secagg.unmask``'s."""

    name = Phase.UNMASK
    message_type = UnmaskResponse

    def __init__(self, server: SecAggServer, expected: frozenset[int], position: int, masked: np.ndarray,
                 survivors: frozenset[int]) -> None:
        super().__init__(server, expected, position)
        config = server.config
        self.masked = masked
        self.survivors: frozenset[int] = survivors
        self.dropped: frozenset[int] = server.sharers - survivors
        self.secrets = NeededSecrets(config, survivors, self.dropped, expected)
        self.shares = ShareBook(len(self.secrets.rows), config.threshold)
        self.rebuilder = SecretRebuilder(config, self.sum_id, position, self.secrets.rows, server.advertised,
                                         server.misbehaving)

    def status(self, device: int) -> tuple[int, ...]:
        """What device's UnmaskRequest lists: itself and its surviving neighbours."""
        return self.secrets.expect.status(device)

    def validate(self, message: UnmaskResponse) -> None:
        """An answer names its surviving neighbours' seeds, then its dropped neighbours' keys;
        the usual ascending order is checked against the owners expected of the sender in one
        comparison, any other order is sorted first."""
        sender = message.sender
        seeds, keys, rows = self.secrets.expect.of(sender)
        seed_owners, key_owners = message.seed_owners, message.key_owners
        usual = type(seed_owners) is tuple and type(key_owners) is tuple  # what the wire decodes
        if not (usual and seed_owners == seeds and key_owners == keys):
            seed_array = _owners(sender, seed_owners)
            key_array = _owners(sender, key_owners)
            if not np.array_equal(np.sort(seed_array), seeds):
                raise MalformedMessage(
                    f"device {sender} must reveal seed shares of exactly its surviving neighbours"
                )
            if not np.array_equal(np.sort(key_array), keys):
                raise MalformedMessage(
                    f"device {sender} must reveal key shares of exactly its dropped neighbours"
                )
            rows = self.secrets.row_of[np.concatenate([seed_array, key_array])]
        size = shamir.SHARE_BYTES
        blocks = message.seed_shares, message.key_shares
        if (not all(isinstance(b, bytes) for b in blocks)
                or len(blocks[0]) != size * len(seeds) or len(blocks[1]) != size * len(keys)):
            raise MalformedMessage(f"device {sender}: shares must be {size} bytes, one per owner named")
        self._validated = (message, rows, np.frombuffer(b"".join(blocks), dtype=SHARE))

    def record(self, message: UnmaskResponse) -> None:
        validated, rows, shares = self._validated
        assert validated is message
        self.shares.add(message.sender, rows, shares)  # a message names each owner once

    def complete(self) -> bool:
        """Done when every needed secret has its shares: stragglers cannot delay the sum."""
        return self.shares.have_wanted() or super().complete()

    def close(self) -> list[Outgoing]:
        return self._finish(final=not self.pending)

    def expire(self) -> list[Outgoing]:
        return self._finish(final=True)

    def _finish(self, final: bool) -> list[Outgoing]:
        server = self.server
        short = self.shares.below_threshold()
        if short.size:
            owners = [self.secrets.rows[r][1] for r in short[:10].tolist()]
            return server._abort(
                f"unmask[{self.sum_id}]: fewer than t={server.config.threshold} shares for devices {owners}"
                + (" ..." if short.size > 10 else ""),
                self.expected,
            )
        failed = self.rebuilder.rebuild(self.shares)
        if failed and not final:
            self.shares.want_more(failed)
            return []
        if failed:
            owners = sorted(self.secrets.rows[r][1] for r in failed)
            return server._abort(
                f"unmask[{self.sum_id}]: the shares of devices {owners[:10]} do not rebuild the "
                "secrets they committed to, and too few holders answered to decode around the "
                "wrong ones",
                self.expected,
            )
        seeds, keys = self.rebuilder.by_owner()
        server.revealed_seeds[self.sum_id] = frozenset(seeds)
        server.revealed_keys[self.sum_id] = frozenset(keys)
        total = remove_masks(server.config, self.position, self.masked, self.survivors, seeds, keys,
                             server.advertised)
        result = SumResult(
            self.sum_id, total, tuple(sorted(self.survivors)), tuple(sorted(self.dropped)),
            tuple(sorted(server.excluded.items())), tuple(sorted(server.convicted & server.excluded.keys())),
        )
        server.results[self.sum_id] = result
        # Stragglers the early close did not wait for are alive: ask every contributor.
        return server._start_sum(self.position + 1, self.survivors)


def _owners(sender: int, owners: tuple[int, ...]) -> np.ndarray:
    return device_list(owners, f"device {sender}: share owners")
