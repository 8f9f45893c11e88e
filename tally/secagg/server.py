"""Server half of the secure sum: a sans-IO state machine, one small class per phase.

Feed it device messages (``receive``) and deadline events (``on_deadline``); it returns
the messages to send. It never sees a device's input in the clear: it holds masked
vectors and, per sum, reconstructs either a device's self-mask seed (it survived) or
its mask key (it dropped), never both.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable

import numpy as np

from tally.codec import packed_size, ring_dtype, ring_mask, unpack
from tally.secagg import crypto, shamir
from tally.secagg.config import SessionConfig
from tally.secagg.errors import (
    DuplicateMessage,
    MalformedMessage,
    OutOfPhase,
    SessionAbortedError,
    StaleMessage,
    UnknownSender,
)
from tally.secagg.messages import (
    Abort,
    AdvertiseKeys,
    ClientMessage,
    ConsistencyCheckRequest,
    ConsistencyCheckResponse,
    MaskedInputRequest,
    MaskedInputResponse,
    NeighbourKeys,
    Outgoing,
    SessionAborted,
    ShareDelivery,
    ShareKeysRequest,
    ShareKeysResponse,
    SumResult,
    SumSpec,
    UnmaskRequest,
    UnmaskResponse,
)
from tally.secagg.wire import SHARE_CIPHERTEXT_BYTES, consistency_message


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
        everyone = frozenset(range(1, config.n + 1))
        self._phase: _Phase = (
            _NotStarted(self, everyone) if config.plain else _AdvertiseKeysPhase(self, everyone)
        )

    @property
    def phase(self) -> str:
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
        return self._phase.close()

    # -- used by the phases ----------------------------------------------------

    def _advance(self, phase: _Phase, outgoing: list[Outgoing]) -> list[Outgoing]:
        self._phase = phase
        return outgoing

    def _abort(self, reason: str, recipients: Iterable[int]) -> list[Outgoing]:
        self.aborted = SessionAborted(reason)
        self._phase = _Finished(self, frozenset())
        return [Outgoing(i, Abort(self.config.ref, reason)) for i in sorted(recipients)]

    def _require(self, survivors: frozenset[int], phase: str, notify: Iterable[int]):
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


class _Phase(abc.ABC):
    name = ""
    message_type: type = object

    def __init__(self, server: SecAggServer, expected: frozenset[int]) -> None:
        self.server = server
        self.expected = expected
        self.received: dict[int, ClientMessage] = {}
        # Who the phase still waits for: kept incrementally, so a message costs O(1), not O(n).
        self.pending: set[int] = set(expected) - server.lost

    @property
    def sum_id(self) -> str:
        return ""

    def accept(self, message: ClientMessage) -> list[Outgoing]:
        if not isinstance(message, self.message_type):
            raise OutOfPhase(
                f"{type(message).__name__} received while the session is in {self.name}"
            )
        if getattr(message, "sum_id", "") != self.sum_id:
            raise StaleMessage(
                f"{type(message).__name__} for sum {message.sum_id!r} received while "
                f"sum {self.sum_id!r} is in {self.name}"
            )
        if message.sender in self.received:
            raise DuplicateMessage(f"device {message.sender} already sent {self.name}")
        if message.sender not in self.expected:
            raise OutOfPhase(f"device {message.sender} is not part of {self.name}")
        self.validate(message)
        self.received[message.sender] = message
        self.pending.discard(message.sender)
        self.record(message)
        if self.complete():
            return self.close()
        return []

    def complete(self) -> bool:
        return not self.pending

    def record(self, message: ClientMessage) -> None:
        """Phase-specific bookkeeping of a validated message."""

    @abc.abstractmethod
    def validate(self, message: ClientMessage) -> None: ...

    @abc.abstractmethod
    def close(self) -> list[Outgoing]: ...


class _Finished(_Phase):
    name = "finished"

    def validate(self, message: ClientMessage) -> None:
        raise OutOfPhase("session is finished")

    def accept(self, message: ClientMessage) -> list[Outgoing]:
        if self.server.aborted is not None:
            raise SessionAbortedError(f"session aborted: {self.server.aborted.reason}")
        raise OutOfPhase(f"session is finished; {type(message).__name__} is too late")

    def close(self) -> list[Outgoing]:
        return []


class _NotStarted(_Phase):
    """A plain session before ``start()``, while devices join: they only speak when asked."""

    name = "join"
    message_type = ()

    def validate(self, message: ClientMessage) -> None:
        raise OutOfPhase("session has not started")

    def close(self) -> list[Outgoing]:
        return self.server._start_sum(0, self.expected - self.server.lost)


class _AdvertiseKeysPhase(_Phase):
    name = "advertise_keys"
    message_type = AdvertiseKeys

    def validate(self, message: AdvertiseKeys) -> None:
        config = self.server.config
        ids = tuple(k.sum_id for k in message.keys)
        expected_ids = tuple(s.sum_id for s in config.sums)
        if ids != expected_ids:
            raise MalformedMessage(f"keys for sums {ids}, expected {expected_ids}")
        for keys in message.keys:
            if len(keys.cipher_public) != 32 or len(keys.mask_public) != 32:
                raise MalformedMessage("public keys must be 32 bytes")
        if config.consistency_check and len(message.signing_public) != 32:
            raise MalformedMessage("a 32-byte Ed25519 signing key is required")

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
        keys = {i: NeighbourKeys(i, self.received[i].keys, self.received[i].signing_public) for i in u1}
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


class _ShareKeysPhase(_Phase):
    name = "share_keys"
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
            if len(share.ciphertext) != SHARE_CIPHERTEXT_BYTES:
                raise MalformedMessage(
                    f"share ciphertext must be {SHARE_CIPHERTEXT_BYTES} bytes"
                )

    def close(self) -> list[Outgoing]:
        server = self.server
        u2 = frozenset(self.received)
        refused = server._require(u2, self.name, u2)
        if refused is not None:
            return refused
        server.sharers = u2
        inbox: dict[int, list] = {j: [] for j in u2}
        for sender in sorted(u2):
            for share in self.received[sender].shares:
                if share.recipient in inbox:
                    inbox[share.recipient].append(share)
        out = [Outgoing(j, ShareDelivery(server.config.ref, tuple(inbox[j]))) for j in sorted(u2)]
        out += server._start_sum(0, u2)
        return out


class _SumPhase(_Phase):
    def __init__(self, server: SecAggServer, expected: frozenset[int], position: int) -> None:
        super().__init__(server, expected)
        self.position = position

    @property
    def sum_id(self) -> str:
        return self.server.config.sums[self.position].sum_id


class _MaskedInputPhase(_SumPhase):
    name = "masked_input"
    message_type = MaskedInputResponse

    def validate(self, message: MaskedInputResponse) -> None:
        spec = self.server.config.sums[self.position]
        size = packed_size(spec.dim, spec.wire_bits)
        if len(message.data) != size:
            raise MalformedMessage(
                f"masked input for sum {spec.sum_id!r} must be {size} bytes, got {len(message.data)}"
            )

    def close(self) -> list[Outgoing]:
        server = self.server
        u3 = frozenset(self.received)
        refused = server._require(u3, f"{self.name}[{self.sum_id}]", self.expected)
        if refused is not None:
            return refused
        ref, sum_id = server.config.ref, self.sum_id
        survivors = tuple(sorted(u3))
        masked = {i: self.received[i].data for i in u3}
        if server.config.consistency_check:
            out = [Outgoing(i, ConsistencyCheckRequest(ref, sum_id, survivors)) for i in survivors]
            return server._advance(_ConsistencyPhase(server, u3, self.position, masked), out)
        # A device needs only its own neighbourhood's status: the full list would make every
        # request O(n) and the session O(n^2) bytes. (ConsistencyCheck signs the full list.)
        out = [
            Outgoing(i, UnmaskRequest(ref, sum_id, tuple(sorted(u3.intersection(server.config.neighbours(i).tolist()) | {i}))))
            for i in survivors
        ]
        return server._advance(_UnmaskPhase(server, u3, self.position, masked, u3), out)


class _PlainSumPhase(_MaskedInputPhase):
    """Benchmark-only: the inputs arrive unmasked, so the sum is simply their sum."""

    def close(self) -> list[Outgoing]:
        server = self.server
        u3 = frozenset(self.received)
        refused = server._require(u3, f"plain_sum[{self.sum_id}]", self.expected)
        if refused is not None:
            return refused
        spec = server.config.sums[self.position]
        total = _add_packed(spec, (self.received[i].data for i in sorted(u3)))
        np.bitwise_and(total, total.dtype.type(ring_mask(spec.bits)), out=total)
        dropped = frozenset(range(1, server.config.n + 1)) - u3
        server.results[self.sum_id] = SumResult(
            self.sum_id, total, tuple(sorted(u3)), tuple(sorted(dropped))
        )
        return server._start_sum(self.position + 1, u3)


def _add_packed(spec: SumSpec, vectors: Iterable[bytes]) -> np.ndarray:
    """The ring sum (not yet reduced) of packed vectors of sum ``spec``."""
    total = np.zeros(spec.dim, dtype=ring_dtype(spec.bits))
    for data in vectors:
        np.add(total, unpack(data, spec.wire_bits, spec.dim), out=total)
    return total


class _ConsistencyPhase(_SumPhase):
    name = "consistency_check"
    message_type = ConsistencyCheckResponse

    def __init__(self, server, expected, position, masked: dict[int, bytes]) -> None:
        super().__init__(server, expected, position)
        self.masked = masked
        self.statement = consistency_message(server.config.ref, self.sum_id, sorted(expected))

    def validate(self, message: ConsistencyCheckResponse) -> None:
        public = self.server.advertised[message.sender].signing_public
        if not crypto.verify_signature(public, message.signature, self.statement):
            raise MalformedMessage(f"device {message.sender}: invalid survivor-set signature")

    def close(self) -> list[Outgoing]:
        server = self.server
        u4 = frozenset(self.received)
        refused = server._require(u4, f"{self.name}[{self.sum_id}]", self.expected)
        if refused is not None:
            return refused
        survivors = tuple(sorted(self.expected))
        signatures = tuple((i, self.received[i].signature) for i in sorted(u4))
        request = UnmaskRequest(server.config.ref, self.sum_id, survivors, signatures)
        out = [Outgoing(i, request) for i in sorted(u4)]
        return server._advance(
            _UnmaskPhase(server, u4, self.position, self.masked, self.expected), out
        )


class _UnmaskPhase(_SumPhase):
    name = "unmask"
    message_type = UnmaskResponse

    def __init__(self, server, expected, position, masked: dict[int, bytes], survivors) -> None:
        super().__init__(server, expected, position)
        self.masked = masked
        self.survivors: frozenset[int] = survivors
        self.dropped: frozenset[int] = server.sharers - survivors
        # Only dropped devices that share an edge with a survivor left masks behind.
        self.needed_keys = frozenset(
            j for j in self.dropped if any(int(i) in survivors for i in server.config.neighbours(j))
        )
        self.seed_shares: dict[int, dict[int, bytes]] = {i: {} for i in survivors}
        self.key_shares: dict[int, dict[int, bytes]] = {j: {} for j in self.needed_keys}
        # Secrets still below t shares, kept up to date so completion is O(1) per message.
        self.short: set[tuple[str, int]] = {("seed", i) for i in survivors} | {("key", j) for j in self.needed_keys}

    def validate(self, message: UnmaskResponse) -> None:
        held = self.server.sharers.intersection(self.server.config.neighbours(message.sender).tolist())
        seed_owners = {o for o, _ in message.seed_shares}
        key_owners = {o for o, _ in message.key_shares}
        if len(seed_owners) != len(message.seed_shares) or seed_owners != held & self.survivors:
            raise MalformedMessage(
                f"device {message.sender} must reveal seed shares of exactly its surviving neighbours"
            )
        if len(key_owners) != len(message.key_shares) or key_owners != held & self.dropped:
            raise MalformedMessage(
                f"device {message.sender} must reveal key shares of exactly its dropped neighbours"
            )
        if any(len(share) != shamir.SHARE_BYTES for _, share in message.seed_shares + message.key_shares):
            raise MalformedMessage(f"shares must be {shamir.SHARE_BYTES} bytes")

    def record(self, message: UnmaskResponse) -> None:
        t = self.server.config.threshold
        for kind, owners, shares in (
            ("seed", self.seed_shares, message.seed_shares),
            ("key", self.key_shares, message.key_shares),
        ):
            for owner, share in shares:
                held = owners.get(owner)
                if held is None:  # a dropped device with no surviving neighbour: nothing to remove
                    continue
                held[message.sender] = share
                if len(held) == t:
                    self.short.discard((kind, owner))

    def complete(self) -> bool:
        """Done when every needed secret has t shares: stragglers cannot delay the sum."""
        return not self.short or super().complete()

    def close(self) -> list[Outgoing]:
        server = self.server
        t = server.config.threshold
        short = sorted(owner for _, owner in self.short)
        if short:
            return server._abort(
                f"unmask[{self.sum_id}]: fewer than t={t} shares for devices {short[:10]}"
                + (" ..." if len(short) > 10 else ""),
                self.expected,
            )
        try:
            total = self._unmask()
        except (ValueError, crypto.CryptoError) as exc:
            return server._abort(f"unmask[{self.sum_id}]: inconsistent shares: {exc}", self.expected)
        result = SumResult(
            self.sum_id, total, tuple(sorted(self.survivors)), tuple(sorted(self.dropped))
        )
        server.results[self.sum_id] = result
        # Stragglers the early close did not wait for are alive: ask every contributor.
        return server._start_sum(self.position + 1, self.survivors)

    def _reconstruct(self, owners_shares: dict[int, dict[int, bytes]]) -> dict[int, bytes]:
        t = self.server.config.threshold
        owners = sorted(owners_shares)
        holder_sets, share_arrays = [], []
        for owner in owners:
            holders = sorted(owners_shares[owner])[:t]
            holder_sets.append(tuple(holders))
            joined = b"".join(owners_shares[owner][h] for h in holders)
            share_arrays.append(np.frombuffer(joined, dtype="<u4").reshape(t, shamir.CHUNKS))
        return dict(zip(owners, shamir.reconstruct(holder_sets, share_arrays)))

    def _unmask(self) -> np.ndarray:
        server = self.server
        spec = server.config.sums[self.position]
        context = server.config.ref.context(spec.sum_id)
        seeds = self._reconstruct(self.seed_shares)
        keys = self._reconstruct(self.key_shares)
        server.revealed_seeds[spec.sum_id] = frozenset(seeds)
        server.revealed_keys[spec.sum_id] = frozenset(keys)
        assert not (set(seeds) & set(keys)), "a device's seed and key were both reconstructed"

        total = _add_packed(spec, (self.masked[i] for i in sorted(self.survivors)))
        dtype = total.dtype
        expander = crypto.MaskExpander(spec.dim, dtype)
        for i, seed in seeds.items():
            expander.apply(total, crypto.self_mask_key(seed, context), subtract=True)
        position = self.position
        for j, private in keys.items():
            pair = crypto.KeyPair(private)
            if pair.public != server.advertised[j].keys[position].mask_public:
                raise ValueError(f"reconstructed mask key of device {j} does not match its public key")
            for i in server.config.neighbours(j):
                i = int(i)
                if i not in self.survivors:
                    continue
                peer = server.advertised[i].keys[position].mask_public
                key = crypto.pairwise_mask_key(pair.agree(peer), context)
                # Device i added the mask when i < j and subtracted it otherwise.
                expander.apply(total, key, subtract=i < j)
        np.bitwise_and(total, dtype.type(ring_mask(spec.bits)), out=total)
        return total
