"""Device half of the secure sum: a sans-IO state machine, one small class per phase.

The device checks what it can check locally: the configuration against its own policy, its
neighbourhood from the public graph seed, every neighbour's keys against the identity key the
coordinator's roster lists for it (the aggregator relays them and must not be able to substitute
its own), ciphertexts bound to their route. It masks its input only once at least t neighbours
hold its shares, answers Unmask once per sum, and refuses to help unmask when too few of its
neighbours survived (which would let a server isolate one device's input). Against a malicious
server it answers only from the survivor view it signed, once t of its neighbours are shown to
have signed views that count it as a survivor (``_AwaitUnmask._check_signatures`` says why that
stops a server that shows different devices different survivor sets).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable
from typing import Any, Generic, NoReturn, TypeVar

import numpy as np

from tally.codec import pack, ring_dtype, ring_mask
from tally.secagg import crypto, shamir, sharecheck
from tally.secagg.config import SessionConfig
from tally.secagg.errors import (
    DuplicateMessage,
    MalformedMessage,
    OutOfPhase,
    SessionAbortedError,
    StaleMessage,
)
from tally.secagg.layouts import (
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
    RevealedShareKey,
    ServerMessage,
    ShareCheck,
    ShareComplaint,
    ShareComplaints,
    ShareDelivery,
    ShareKeysRequest,
    ShareKeysResponse,
    ShareVerdict,
    SumPublicKeys,
    UnmaskRequest,
    UnmaskResponse,
)
from tally.secagg.phases import Phase
from tally.secagg.policy import DevicePolicy


class _SumSecrets:
    """The key pairs and self-mask seed of one sum: never reused by another sum. The seed is a
    scalar mod l and the mask key shared as the scalar that stands for it (``crypto.mask_scalar``),
    so both are committed in the group their shares are checked in (``sharecheck``)."""

    def __init__(self, entropy: Callable[[int], bytes]) -> None:
        self.cipher = crypto.KeyPair(entropy(32))
        self.mask = crypto.KeyPair(entropy(32))
        self.seed = crypto.random_scalar(entropy)
        self.pair_keys: dict[int, bytes] = {}  # neighbour -> pairwise mask AES key
        self.cipher_secrets: dict[int, bytes] = {}  # neighbour -> X25519 secret for shares
        self.cipher_publics: dict[int, bytes] = {}  # neighbour -> its signed cipher key
        self.held: dict[int, tuple[bytes, bytes]] = {}  # neighbour -> (key share, seed share)
        # As dealer: the ciphertext sent to each holder and the check published for them, so a
        # complaint can be judged against what was really sent.
        self.dealt: dict[int, bytes] = {}
        self.check_digest = b""
        self.check_message = b""
        # As holder: the share material each complaint was about, until the verdict settles it.
        self.complained: dict[int, tuple[bytes, bytes]] = {}


class SecAggClient:
    """``identity`` is the device's enrolled long-term key; ``policy`` what it accepts (checked
    before anything else); ``entropy`` the source of every session key and seed: os.urandom, or
    a seeded source in tests that must be deterministic. Adversaries for load and attack tests
    subclass it and override a step (``tally.secagg.adversary``)."""

    def __init__(
        self,
        config: SessionConfig,
        index: int,
        identity: crypto.SigningKey,
        *,
        policy: DevicePolicy | None = None,
        entropy: Callable[[int], bytes] = os.urandom,
    ) -> None:
        if not 1 <= index <= config.n:
            raise ValueError(f"index {index} is outside the cohort 1..{config.n}")
        (policy or DevicePolicy()).check(config, index, identity.public)
        self.config = config
        self.index = index
        self.identity = identity
        self.neighbours = frozenset(int(j) for j in config.neighbours(index))
        self.secrets = (
            {} if config.plain else {spec.sum_id: _SumSecrets(entropy) for spec in config.sums}
        )
        self.inputs: dict[str, np.ndarray] = {}
        self.aborted: str | None = None
        # A plain session (benchmarks only) has no keys: it waits for the first input request.
        self._phase: _AnyPhase = (
            _AwaitMaskedInputRequest(self, 0) if config.plain else _AwaitShareKeysRequest(self)
        )

    @property
    def phase(self) -> str:
        return self._phase.name

    @property
    def finished(self) -> bool:
        return isinstance(self._phase, _Done)

    @property
    def awaiting_input(self) -> str | None:
        """The sum the server asked for whose input the caller has not provided yet."""
        phase = self._phase
        return phase.sum_id if isinstance(phase, _AwaitInput) else None

    def start(self) -> list[ClientMessage]:
        if self.config.plain:
            return []
        ref = self.config.ref
        keys = tuple(
            SumPublicKeys(
                spec.sum_id, s.cipher.public, s.mask.public, crypto.public_of_scalar(s.seed)
            )
            for spec, s in zip(self.config.sums, self.secrets.values())
        )
        signature = self.identity.sign(advertise_statement(ref, self.index, keys))
        return [AdvertiseKeys(ref, self.index, keys, signature)]

    def receive(self, message: ServerMessage) -> list[ClientMessage]:
        if message.ref != self.config.ref:
            raise StaleMessage(f"message for {message.ref} reached session {self.config.ref}")
        if isinstance(message, Abort):
            self.aborted = message.reason
            self._phase = _Done(self)
            return []
        if isinstance(self._phase, _Done):
            if self.aborted is not None:
                raise SessionAbortedError(f"session aborted: {self.aborted}")
            raise OutOfPhase("session is finished")
        return self._phase.handle(message)

    def provide_input(self, sum_id: str, vector: np.ndarray) -> list[ClientMessage]:
        """Hand over the ring-encoded input of one sum (before or after the server asks)."""
        spec = self.config.sum_spec(sum_id)
        vector = np.asarray(vector)
        if vector.shape != (spec.dim,) or vector.dtype != ring_dtype(spec.bits):
            raise ValueError(f"input for {sum_id!r} must be {ring_dtype(spec.bits)}[{spec.dim}]")
        if int(vector.max(initial=0)) > ring_mask(spec.bits):
            raise ValueError(f"input for {sum_id!r} has values outside 2**{spec.bits}")
        if sum_id in self.inputs:
            raise DuplicateMessage(f"input for {sum_id!r} was already provided")
        self.inputs[sum_id] = vector
        if isinstance(self._phase, _AwaitInput) and self._phase.sum_id == sum_id:
            return self._phase.send_masked_input()
        return []

    def shared_secrets(self, key: int, seed: int) -> tuple[int, int]:
        """The mask key and seed (scalars) whose shares this device deals for one sum."""
        return key, seed

    def dealt_rows(self, rows: list[list[int]]) -> list[list[int]]:
        """The share rows this device deals for one sum, one per holder in ascending order (key
        share, seed share, blinding share), before they are sealed."""
        return rows

    def sealing_key(self, holder: int, key: bytes) -> bytes:
        """The key the share for the ``holder``-th neighbour (ascending) is sealed under."""
        return key

    def sealed_share(self, holder: int, ciphertext: bytes) -> bytes:
        """The sealed share for the ``holder``-th neighbour (ascending), as it is sent."""
        return ciphertext

    def _move(self, phase: _AnyPhase, out: list[ClientMessage]) -> list[ClientMessage]:
        self._phase = phase
        return out

    def _refuse(self, reason: str) -> NoReturn:
        """Stop for good: the device will not take the step the server asked for."""
        self.aborted = reason
        self._phase = _Done(self)
        raise SessionAbortedError(reason)


def _check_neighbour(config: SessionConfig, neighbour: NeighbourKeys) -> None:
    """A neighbour's keys, as the aggregator relayed them, must be the ones that neighbour
    signed with the identity key the coordinator's roster lists for it."""
    j = neighbour.index
    ids = tuple(k.sum_id for k in neighbour.keys)
    if ids != tuple(s.sum_id for s in config.sums):
        raise MalformedMessage(f"neighbour {j} sent keys for sums {ids}")
    statement = advertise_statement(config.ref, j, neighbour.keys)
    if not crypto.verify_signature(config.identity(j), neighbour.signature, statement):
        raise MalformedMessage(
            f"neighbour {j}'s keys are not signed by its enrolled identity key: refusing them"
        )


M = TypeVar("M", bound=ServerMessage)  # the message a phase takes


class _Phase(abc.ABC, Generic[M]):
    name = ""
    accepts: type[M] | tuple[type[M], ...] = ()

    def __init__(self, client: SecAggClient) -> None:
        self.client = client

    def handle(self, message: ServerMessage) -> list[ClientMessage]:
        if not isinstance(message, self.accepts):
            raise OutOfPhase(f"{type(message).__name__} received while the device is in {self.name}")
        return self.on(message)

    @abc.abstractmethod
    def on(self, message: M) -> list[ClientMessage]: ...


# The device holds whichever phase is current and drives it through ``handle``, which takes any
# ServerMessage: what a phase takes is its own business.
_AnyPhase = _Phase[Any]


class _Done(_Phase[ServerMessage]):
    name = "done"

    def on(self, message: ServerMessage) -> list[ClientMessage]:
        raise OutOfPhase("session is finished")


class _AwaitShareKeysRequest(_Phase[ShareKeysRequest]):
    name = Phase.ADVERTISE_KEYS
    accepts = ShareKeysRequest

    def on(self, message: ShareKeysRequest) -> list[ClientMessage]:
        client = self.client
        config = client.config
        indices = [nb.index for nb in message.neighbours]
        if len(set(indices)) != len(indices) or not set(indices) <= client.neighbours:
            raise MalformedMessage("the server sent keys of devices that are not my neighbours")
        if len(indices) < config.threshold:
            raise MalformedMessage(
                f"{len(indices)} neighbours cannot hold shares with threshold {config.threshold}"
            )
        for nb in message.neighbours:
            _check_neighbour(config, nb)
        xs = np.array(sorted(indices), dtype=np.int64)
        by_index = {nb.index: nb for nb in message.neighbours}
        shares_out: list[EncryptedShare] = []
        checks: list[ShareCheck] = []
        for position, spec in enumerate(config.sums):
            secrets = client.secrets[spec.sum_id]
            shares_out += self._deal(spec.sum_id, position, secrets, xs, by_index)
            checks.append(ShareCheck(spec.sum_id, secrets.check_message))
        response = ShareKeysResponse(config.ref, client.index, tuple(shares_out), tuple(checks))
        return client._move(_AwaitShareDelivery(client, frozenset(indices)), [response])

    def _deal(self, sum_id: str, position: int, secrets: _SumSecrets, xs: np.ndarray,
              by_index: dict[int, NeighbourKeys]) -> list[EncryptedShare]:
        """Shares of this sum's mask key and seed for each neighbour, with its share of the
        blinding polynomial, encrypted for it; then the check over all ciphertexts."""
        client = self.client
        config = client.config
        context = config.ref.context(sum_id)
        t = config.threshold
        key, seed = client.shared_secrets(crypto.mask_scalar(secrets.mask.private), secrets.seed)
        *secret_polynomials, blinding = shamir.polynomials([key, seed, crypto.random_scalar()], t)
        holders = xs.tolist()
        columns = shamir.evaluate([*secret_polynomials, blinding], holders)
        # One row per holder: its key share, its seed share, its blinding share.
        rows = client.dealt_rows([list(row) for row in zip(*columns)])
        out = []
        for h, j in enumerate(holders):
            keys = by_index[j].keys[position]
            try:
                cipher_secret = secrets.cipher.agree(keys.cipher_public)
                mask_secret = secrets.mask.agree(keys.mask_public)
            except crypto.CryptoError as exc:
                raise MalformedMessage(f"neighbour {j}'s keys for sum {sum_id!r}: {exc}") from None
            secrets.cipher_secrets[j] = cipher_secret
            secrets.cipher_publics[j] = keys.cipher_public
            secrets.pair_keys[j] = crypto.pairwise_mask_key(mask_secret, context)
            sealing = client.sealing_key(h, crypto.share_key(cipher_secret, context, client.index, j))
            ad = share_associated_data(config.ref, sum_id, client.index, j)
            plaintext = b"".join(crypto.scalar_bytes(v % shamir.P) for v in rows[h])
            ciphertext = client.sealed_share(h, crypto.seal(sealing, plaintext, ad))
            secrets.dealt[j] = ciphertext
            out.append(EncryptedShare(sum_id, client.index, j, ciphertext))
        secrets.check_digest = sharecheck.digest(config.ref, sum_id, client.index, list(secrets.dealt.values()))
        secrets.check_message = sharecheck.check_message(secret_polynomials, blinding, secrets.check_digest)
        return out


class _AwaitShareDelivery(_Phase[ShareDelivery]):
    """Checks every delivered share against its dealer's check and answers with a signed
    complaint for each that fails to decrypt or check. It never aborts over one dealer's bad
    share, nor drops that dealer on its own: the verdict decides for every device at once."""

    name = Phase.SHARE_KEYS
    accepts = ShareDelivery

    def __init__(self, client: SecAggClient, keyed: frozenset[int]) -> None:
        super().__init__(client)
        self.keyed = keyed

    def on(self, message: ShareDelivery) -> list[ClientMessage]:
        client = self.client
        config = client.config
        senders: dict[str, set[int]] = {spec.sum_id: set() for spec in config.sums}
        complaints: list[ShareComplaint] = []
        for share in message.shares:
            if share.recipient != client.index or share.sender not in self.keyed:
                raise MalformedMessage(f"share from {share.sender} to {share.recipient} is not for me")
            if share.sum_id not in senders or share.sender in senders[share.sum_id]:
                raise MalformedMessage(f"unexpected or repeated share for sum {share.sum_id!r}")
            if (len(share.ciphertext) != SHARE_CIPHERTEXT_BYTES
                    or len(share.check) != sharecheck.check_bytes_for(config.threshold)):
                raise MalformedMessage("share ciphertext or check has the wrong size")
            senders[share.sum_id].add(share.sender)
            secrets = client.secrets[share.sum_id]
            key = crypto.share_key(secrets.cipher_secrets[share.sender], config.ref.context(share.sum_id),
                                   share.sender, client.index)
            plaintext = _open_share(config, share, key)
            if plaintext is None:
                secrets.complained[share.sender] = (share.ciphertext, share.check)
                statement = sharecheck.complaint_statement(
                    config.ref, share.sum_id, share.sender, client.index, share.ciphertext, share.check)
                complaints.append(ShareComplaint(share.sum_id, share.sender, client.index,
                                                 client.identity.sign(statement)))
            else:
                secrets.held[share.sender] = plaintext
        if len({frozenset(s) for s in senders.values()}) > 1:
            raise MalformedMessage("shares of different sums came from different neighbours")
        delivered = frozenset(next(iter(senders.values())))
        _require_holders(client, len(delivered), "of my neighbours' shares were delivered")
        response = ShareComplaints(config.ref, client.index, tuple(complaints))
        return client._move(_AwaitShareVerdict(client, delivered), [response])


def _open_share(config: SessionConfig, share: EncryptedShare, key: bytes) -> tuple[bytes, bytes] | None:
    """(key share, seed share) of a share that decrypts under ``key`` and passes its check."""
    ad = share_associated_data(config.ref, share.sum_id, share.sender, share.recipient)
    try:
        plaintext = crypto.open_sealed(key, share.ciphertext, ad)
    except crypto.CryptoError:
        return None
    if not sharecheck.passes(plaintext, share.check, share.recipient):
        return None
    size = shamir.SHARE_BYTES
    return plaintext[:size], plaintext[size : 2 * size]


def _require_holders(client: SecAggClient, count: int, what: str) -> None:
    if count < client.config.threshold:
        # Fewer than t holders: the server could rebuild nothing of ours, but with fewer
        # pairwise masks than the threshold assumes our input would be exposed.
        client._refuse(
            f"only {count} {what}, below the threshold {client.config.threshold}: refusing to send my input"
        )


class _AwaitShareVerdict(_Phase[JustifyRequest | ShareVerdict]):
    """Until the verdict: a dealer answers complaints about its genuine shares with their keys
    (the complainer is lying or this device is faulty; either way the share is already the
    complainer's); then the excluded dealers are treated as never having shared, and this
    device's complaints must each be settled by an exclusion or a key that opens a good share."""

    name = Phase.SHARE_VERDICT
    accepts = (JustifyRequest, ShareVerdict)

    def __init__(self, client: SecAggClient, delivered: frozenset[int]) -> None:
        super().__init__(client)
        self.delivered = delivered
        self.justified = False  # the server gets justifications once per session

    def on(self, message: JustifyRequest | ShareVerdict) -> list[ClientMessage]:
        if isinstance(message, JustifyRequest):
            return self._justify(message)
        client = self.client
        config = client.config
        excluded = frozenset(_ascending(tuple(message.excluded), config.n, "the excluded dealers").tolist())
        if not excluded <= self.delivered:
            raise MalformedMessage("the verdict excludes devices that did not deal me shares")
        settled: dict[tuple[str, int], bytes] = {}
        for reveal in message.keys:
            if reveal.holder != client.index or reveal.sum_id not in client.secrets:
                raise MalformedMessage("the verdict settles a complaint that is not mine")
            settled[(reveal.sum_id, reveal.dealer)] = reveal.key
        for spec in config.sums:
            secrets = client.secrets[spec.sum_id]
            for dealer, (ciphertext, check) in secrets.complained.items():
                if dealer in excluded:
                    continue
                proof = settled.pop((spec.sum_id, dealer), None)
                shared = None if proof is None else crypto.verified_shared_secret(
                    proof, secrets.cipher_publics[dealer], secrets.cipher.public,
                    sharecheck.proof_context(config.ref, spec.sum_id, dealer, client.index))
                opened = None if shared is None else _open_share(
                    config, EncryptedShare(spec.sum_id, dealer, client.index, ciphertext, check),
                    crypto.share_key(shared, config.ref.context(spec.sum_id), dealer, client.index))
                if opened is None:
                    raise MalformedMessage(f"my complaint about device {dealer}'s share was not settled")
                secrets.held[dealer] = opened
            secrets.complained.clear()
            for dealer in excluded:
                secrets.held.pop(dealer, None)
            # Pairwise masks only with neighbours that shared and were not excluded: exactly
            # the devices whose masks the server can remove if they drop later.
            secrets.pair_keys = {j: k for j, k in secrets.pair_keys.items() if j in secrets.held}
        if settled:
            raise MalformedMessage("the verdict settles complaints I did not make")
        _require_holders(client, len(self.delivered - excluded), "neighbours' shares remain after exclusions")
        return client._move(_AwaitMaskedInputRequest(client, 0), [])

    def _justify(self, message: JustifyRequest) -> list[ClientMessage]:
        """One answered request per session, at most one complaint per share dealt, none twice: checked
        before any signature, so a server cannot buy the dealer's CPU (or many copies of one
        key) with a request repeating one complaint."""
        client = self.client
        config = client.config
        if self.justified:
            raise MalformedMessage("a second JustifyRequest in this session: complaints are justified once")
        dealt = sum(len(secrets.dealt) for secrets in client.secrets.values())
        if len(message.complaints) > dealt:
            raise MalformedMessage(f"{len(message.complaints)} complaints to justify, but I dealt {dealt} shares")
        if len({(c.sum_id, c.holder) for c in message.complaints}) < len(message.complaints):
            raise MalformedMessage("a complaint to justify is repeated")
        keys = []
        for complaint in message.complaints:
            secrets = client.secrets.get(complaint.sum_id)
            if complaint.dealer != client.index or secrets is None or complaint.holder not in secrets.dealt:
                raise MalformedMessage("a complaint to justify is not about a share I dealt")
            holder = complaint.holder
            check = secrets.check_digest + secrets.check_message
            statement = sharecheck.complaint_statement(
                config.ref, complaint.sum_id, client.index, holder, secrets.dealt[holder], check)
            if not crypto.verify_signature(config.identity(holder), complaint.signature, statement):
                # Device ``holder`` never complained about what this device sent: the server
                # altered the delivery or forged the complaint, and a key would open an honest
                # holder's share to it.
                raise MalformedMessage(f"complaint of device {holder} is not about the share I sent it")
            # The pair's shared secret with a proof that it is the one both keys give: the server
            # re-derives the share key from it, so a share sealed under any other key names
            # this device, not the holder.
            keys.append(RevealedShareKey(complaint.sum_id, client.index, holder, crypto.prove_shared_secret(
                secrets.cipher.private, secrets.cipher_publics[holder],
                sharecheck.proof_context(config.ref, complaint.sum_id, client.index, holder))))
        self.justified = True
        return [JustifyResponse(config.ref, client.index, tuple(keys))]


class _AwaitMaskedInputRequest(_Phase[MaskedInputRequest]):
    name = Phase.MASKED_INPUT
    accepts = MaskedInputRequest

    def __init__(self, client: SecAggClient, position: int) -> None:
        super().__init__(client)
        self.position = position

    def on(self, message: MaskedInputRequest) -> list[ClientMessage]:
        client = self.client
        expected = client.config.sums[self.position].sum_id
        if message.sum_id != expected:
            raise StaleMessage(f"masked input requested for {message.sum_id!r}, expected {expected!r}")
        phase = (_AwaitPlainInput if client.config.plain else _AwaitInput)(client, self.position)
        client._phase = phase
        if expected in client.inputs:
            return phase.send_masked_input()
        return []


class _AwaitInput(_Phase[ServerMessage]):
    name = "awaiting_input"
    accepts = ()  # nothing from the server: the caller provides the input

    def __init__(self, client: SecAggClient, position: int) -> None:
        super().__init__(client)
        self.position = position
        self.sum_id = client.config.sums[position].sum_id

    def on(self, message: ServerMessage) -> list[ClientMessage]:
        raise OutOfPhase("waiting for the local input")

    def send_masked_input(self) -> list[ClientMessage]:
        client = self.client
        spec = client.config.sums[self.position]
        vector = self.protect(client.inputs.pop(spec.sum_id))
        data = pack(vector, spec.wire_bits)
        response = MaskedInputResponse(client.config.ref, spec.sum_id, client.index, data)
        return client._move(self.next_phase(), [response])

    def protect(self, vector: np.ndarray) -> np.ndarray:
        """The input as it goes on the wire: masked by the self mask and the pairwise masks."""
        client = self.client
        config = client.config
        spec = config.sums[self.position]
        secrets = client.secrets[spec.sum_id]
        context = config.ref.context(spec.sum_id)
        masked = vector.copy()
        expander = crypto.MaskExpander(spec.dim, masked.dtype)
        expander.apply(masked, crypto.self_mask_key(secrets.seed, context))
        for j, key in secrets.pair_keys.items():
            expander.apply(masked, key, subtract=client.index > j)
        np.bitwise_and(masked, masked.dtype.type(ring_mask(spec.bits)), out=masked)
        return masked

    def next_phase(self) -> _AnyPhase:
        client = self.client
        if client.config.consistency_check:
            return _AwaitConsistencyCheck(client, self.position)
        return _AwaitUnmask(client, self.position, None)


class _AwaitPlainInput(_AwaitInput):
    """Benchmark-only plain sum: the input goes out unmasked and nothing is unmasked later."""

    def protect(self, vector: np.ndarray) -> np.ndarray:
        return vector

    def next_phase(self) -> _AnyPhase:
        client = self.client
        nxt = self.position + 1
        return _AwaitMaskedInputRequest(client, nxt) if nxt < len(client.config.sums) else _Done(client)


def _ascending(devices: tuple[int, ...], n: int, what: str) -> np.ndarray:
    """A list of device ids as the server must send it: integers in 1..n, strictly ascending
    (so no device is named twice, say once surviving and once not)."""
    ids = device_list(devices, what)
    if ids.size and (ids[0] < 1 or ids[-1] > n or not np.all(ids[1:] > ids[:-1])):
        raise MalformedMessage(f"{what} must name devices of 1..{n} once each, ascending")
    return ids


class _AwaitConsistencyCheck(_Phase[ConsistencyCheckRequest]):
    """The device signs its view (itself and its surviving neighbours) once per sum. An honest
    device signs one view only, so no two views that disagree about a device j can each carry
    the signatures of t of j's neighbours when 2t > k + corrupt neighbours."""

    name = Phase.CONSISTENCY_CHECK
    accepts = ConsistencyCheckRequest

    def __init__(self, client: SecAggClient, position: int) -> None:
        super().__init__(client)
        self.position = position

    def on(self, message: ConsistencyCheckRequest) -> list[ClientMessage]:
        client = self.client
        sum_id = client.config.sums[self.position].sum_id
        if message.sum_id != sum_id:
            raise StaleMessage(f"consistency check for {message.sum_id!r}, expected {sum_id!r}")
        view = _ascending(tuple(message.survivors), client.config.n, "the survivor set")
        if client.index not in view or not client.neighbours.issuperset(set(view.tolist()) - {client.index}):
            raise MalformedMessage("the survivor set must name me and only my neighbours")
        surviving_neighbours = len(view) - 1
        if surviving_neighbours < client.config.threshold:
            client._refuse(
                f"the survivor set holds {surviving_neighbours} of my neighbours, below the "
                f"threshold {client.config.threshold}: refusing to sign it"
            )
        signed = tuple(view.tolist())
        statement = consistency_message(client.config.ref, sum_id, client.index, signed)
        response = ConsistencyCheckResponse(
            client.config.ref, sum_id, client.index, client.identity.sign(statement)
        )
        return client._move(_AwaitUnmask(client, self.position, signed), [response])


class _AwaitUnmask(_Phase[UnmaskRequest]):
    """Answers once, from one survivor set: the view it signed (with the consistency check) or
    the one the request names (semi-honest policy only). Either way the request may name only
    this device's neighbourhood, each device once."""

    name = Phase.UNMASK
    accepts = UnmaskRequest

    def __init__(self, client: SecAggClient, position: int, signed: tuple[int, ...] | None) -> None:
        super().__init__(client)
        self.position = position
        self.signed = signed

    def on(self, message: UnmaskRequest) -> list[ClientMessage]:
        client = self.client
        config = client.config
        sum_id = config.sums[self.position].sum_id
        if message.sum_id != sum_id:
            raise StaleMessage(f"unmask for {message.sum_id!r}, expected {sum_id!r}")
        named = _ascending(tuple(message.survivors), config.n, "the unmask survivor set")
        if self.signed is not None:
            view = self._check_signatures(message, named)
        else:
            view = frozenset(named.tolist())
            if not client.neighbours.issuperset(view - {client.index}):
                raise MalformedMessage("the unmask request names devices that are not my neighbours")
        if client.index not in view:
            raise MalformedMessage("unmask request does not count me as a survivor")
        secrets = client.secrets[sum_id]
        surviving_neighbours = view & secrets.held.keys()
        if len(surviving_neighbours) < config.threshold:
            client._refuse(
                f"only {len(surviving_neighbours)} of my neighbours survived, "
                f"below the threshold {config.threshold}: refusing to unmask"
            )
        seed_owners = tuple(sorted(surviving_neighbours))
        key_owners = tuple(sorted(secrets.held.keys() - view))
        held = secrets.held
        response = UnmaskResponse(
            config.ref, sum_id, client.index,
            seed_owners, b"".join([held[j][1] for j in seed_owners]),
            key_owners, b"".join([held[j][0] for j in key_owners]),
        )
        nxt = self.position + 1
        phase = _AwaitMaskedInputRequest(client, nxt) if nxt < len(config.sums) else _Done(client)
        return client._move(phase, [response])

    def _check_signatures(self, message: UnmaskRequest, named: np.ndarray) -> frozenset[int]:
        """The view this device signed, once t distinct neighbours are shown to have signed
        views that count it as a survivor (each signer's view is read off the survivors named
        within two hops of this device).

        Why that is enough (with 2t > k + c, c the corrupt neighbours any device may have, as
        the parameter finder guarantees): to read device v's input the server needs v's seed
        (t seed shares from v's neighbours, at least t - c of them honest answerers that counted
        v as a survivor) and the pairwise mask of v with every neighbour j it masked with (at
        least t of them). Some honest answerer u of v's seed is one of those j: the two groups
        lie in v's k neighbours and t - c + t > k. u answered, so t of u's neighbours signed
        views with u surviving; the mask of v and u needs u's key (t shares from u's neighbours
        that count u as dropped, each of which, honest, signed that view first) or v's key
        (t from v's neighbours counting v dropped, beside the t - c that counted it surviving).
        Either way two groups of t signers within one neighbourhood of k signed disagreeing
        views, so at least 2t - k > c devices signed both: more than are corrupt."""
        client = self.client
        config = client.config
        if not np.isin(named, config.two_hop_rows(np.array([client.index]))[0]).all():
            raise MalformedMessage("the unmask request names devices more than two hops from me")
        survivors = frozenset(named.tolist())
        if _view(config, client.index, survivors) != self.signed:
            raise MalformedMessage("unmask survivor set differs from the one I signed")
        signers: set[int] = set()
        for j, signature in message.signatures:
            if len(signers) >= config.threshold:
                break
            if type(j) is not int or j not in client.neighbours or j not in self.signed or j in signers:
                continue
            statement = consistency_message(config.ref, message.sum_id, j, _view(config, j, survivors))
            if crypto.verify_signature(config.identity(j), signature, statement):
                signers.add(j)
        if len(signers) < config.threshold:
            raise MalformedMessage(
                f"only {len(signers)} distinct surviving neighbours signed views that count me as "
                f"a survivor, {config.threshold} required"
            )
        return frozenset(self.signed)


def _view(config: SessionConfig, device: int, survivors: frozenset[int]) -> tuple[int, ...]:
    """``device`` and its neighbours that are in ``survivors``, ascending: the view it signs."""
    closed = sorted([*config.neighbours(device).tolist(), device])
    return tuple(i for i in closed if i in survivors)
