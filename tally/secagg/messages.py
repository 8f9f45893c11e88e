"""Messages of the secure-sum protocol, as plain immutable values.

The state machines consume and produce these; the gRPC services translate them to
protobuf and back. Every message names its session (job, round, session id) and,
when it belongs to one sum, the sum: a message of another session or sum is stale.
Devices are named by their 1-based index in the session's cohort, which is also
their Shamir x-coordinate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tally.codec import wire_width


@dataclass(frozen=True)
class SessionRef:
    job_id: str
    round: int
    session_id: str

    def context(self, sum_id: str = "") -> bytes:
        """Bytes that bind keys and ciphertexts to this session (and sum)."""
        return f"{self.job_id}|{self.round}|{self.session_id}|{sum_id}".encode()


@dataclass(frozen=True)
class SumSpec:
    """One secure sum of a session: ``dim`` values, arithmetic mod 2**bits."""

    sum_id: str
    dim: int
    bits: int

    @property
    def wire_bits(self) -> int:
        return wire_width(self.bits)


# ---- device -> server -------------------------------------------------------


@dataclass(frozen=True)
class SumPublicKeys:
    sum_id: str
    cipher_public: bytes  # encrypts the shares this device sends and receives
    mask_public: bytes  # agrees the pairwise mask seeds; also the commitment to the mask key
    # u(seed * B), the self-mask seed's commitment in X25519 form: the share check ties the
    # dealt seed to it before any input is masked, and a rebuilt seed is checked against it.
    seed_commitment: bytes


@dataclass(frozen=True)
class AdvertiseKeys:
    """Signed by the sender's enrolled identity key: the aggregator that relays it to the
    neighbours cannot substitute keys of its own."""

    ref: SessionRef
    sender: int
    keys: tuple[SumPublicKeys, ...]
    signature: bytes


@dataclass(frozen=True)
class EncryptedShare:
    sum_id: str
    sender: int
    recipient: int
    ciphertext: bytes
    # Empty from the dealer; on delivery, the dealer's ciphertext digest and its check (G, then
    # the check polynomial's t coefficients), which the recipient checks its share against
    # (``tally.secagg.sharecheck``).
    check: bytes = b""


@dataclass(frozen=True)
class ShareCheck:
    """A dealer's check for one sum: G = g(0) B (32 bytes), then the check polynomial's t
    coefficients, little-endian scalars mod l, constant first (``tally.secagg.sharecheck``)."""

    sum_id: str
    coefficients: bytes


@dataclass(frozen=True)
class ShareKeysResponse:
    ref: SessionRef
    sender: int
    shares: tuple[EncryptedShare, ...]
    checks: tuple[ShareCheck, ...] = ()


@dataclass(frozen=True)
class ShareComplaint:
    """A holder's signed claim that ``dealer``'s share of one sum fails to decrypt or check."""

    sum_id: str
    dealer: int
    holder: int
    signature: bytes


@dataclass(frozen=True)
class ShareComplaints:
    """Every device answers its delivery, with no complaint when all its shares check."""

    ref: SessionRef
    sender: int
    complaints: tuple[ShareComplaint, ...]


@dataclass(frozen=True)
class RevealedShareKey:
    """What settles a complaint about one share: the pair's Diffie-Hellman point and the dealer's
    proof that it is the one their signed cipher keys give (``crypto.prove_shared_secret``,
    96 bytes); the share's key is derived from it, so it opens that share only."""

    sum_id: str
    dealer: int
    holder: int
    key: bytes


@dataclass(frozen=True)
class JustifyResponse:
    ref: SessionRef
    sender: int
    keys: tuple[RevealedShareKey, ...]


@dataclass(frozen=True)
class MaskedInputResponse:
    ref: SessionRef
    sum_id: str
    sender: int
    data: bytes  # packed at the sum's bit width


@dataclass(frozen=True)
class ConsistencyCheckResponse:
    ref: SessionRef
    sum_id: str
    sender: int
    signature: bytes


@dataclass(frozen=True)
class UnmaskResponse:
    ref: SessionRef
    sum_id: str
    sender: int
    # Surviving neighbours whose self-mask seed shares follow, SHARE_BYTES each, in this order;
    # then the dropped neighbours whose mask-key shares follow. Owners and shares travel as
    # two blocks rather than (owner, share) pairs: the server checks an answer by comparing
    # owner lists and reads its shares in one array, not one pair at a time.
    seed_owners: tuple[int, ...]
    seed_shares: bytes
    key_owners: tuple[int, ...]
    key_shares: bytes


ClientMessage = (
    AdvertiseKeys
    | ShareKeysResponse
    | ShareComplaints
    | JustifyResponse
    | MaskedInputResponse
    | ConsistencyCheckResponse
    | UnmaskResponse
)

# ---- server -> device -------------------------------------------------------


@dataclass(frozen=True)
class NeighbourKeys:
    """A neighbour's AdvertiseKeys as relayed: the recipient checks the signature itself."""

    index: int
    keys: tuple[SumPublicKeys, ...]
    signature: bytes


@dataclass(frozen=True)
class ShareKeysRequest:
    ref: SessionRef
    neighbours: tuple[NeighbourKeys, ...]


@dataclass(frozen=True)
class ShareDelivery:
    """The shares addressed to one device by its neighbours that finished ShareKeys."""

    ref: SessionRef
    shares: tuple[EncryptedShare, ...]


@dataclass(frozen=True)
class JustifyRequest:
    """The complaints against this dealer: it answers each with the share's key, or is excluded."""

    ref: SessionRef
    complaints: tuple[ShareComplaint, ...]


@dataclass(frozen=True)
class ShareVerdict:
    """Sent to every device before any masked input: the dealers excluded for everyone (treated
    as never having shared), and the keys that settle this device's own complaints."""

    ref: SessionRef
    excluded: tuple[int, ...]
    keys: tuple[RevealedShareKey, ...]


@dataclass(frozen=True)
class MaskedInputRequest:
    ref: SessionRef
    sum_id: str


@dataclass(frozen=True)
class ConsistencyCheckRequest:
    ref: SessionRef
    sum_id: str
    survivors: tuple[int, ...]


@dataclass(frozen=True)
class UnmaskRequest:
    ref: SessionRef
    sum_id: str
    survivors: tuple[int, ...]
    signatures: tuple[tuple[int, bytes], ...] = ()


@dataclass(frozen=True)
class Abort:
    ref: SessionRef
    reason: str


ServerMessage = (
    ShareKeysRequest
    | ShareDelivery
    | JustifyRequest
    | ShareVerdict
    | MaskedInputRequest
    | ConsistencyCheckRequest
    | UnmaskRequest
    | Abort
)


@dataclass(frozen=True)
class Outgoing:
    """A server message and the device it goes to."""

    recipient: int
    message: ServerMessage


# ---- server events (not sent to devices) -----------------------------------


@dataclass(frozen=True)
class SumResult:
    """The unmasked total of one sum: ``total`` is mod 2**bits, as the codec decodes it."""

    sum_id: str
    total: np.ndarray = field(repr=False)
    contributors: tuple[int, ...]
    dropped: tuple[int, ...]
    # Dealers excluded before any masked input (``SecAggServer.excluded``): why, per device.
    excluded: tuple[tuple[int, str], ...] = ()
    # Those of them whose misbehaviour is proven (``SecAggServer.convicted``), not merely gone.
    convicted: tuple[int, ...] = ()


@dataclass(frozen=True)
class SessionAborted:
    reason: str
