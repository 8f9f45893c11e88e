"""The survivor-split attack of the third security review, as a malicious aggregator would run it.

``SplitViewServer`` is a ``SecAggServer`` (so the aggregator service can run it in place of the
honest one) that attacks one victim v:

1. ShareKeys: v is delivered the shares of exactly t neighbours H, so v masks with those t only.
2. After MaskedInput it stops being honest. Every other device u is shown its own survivor view:
   v always survives, and up to (neighbours - t) members of H are "dropped", so u still sees t
   surviving neighbours and answers. The views are chosen (a max flow) so that every j in H is
   dropped in the views of t of its neighbours: they reveal j's mask key, while the devices that
   see v surviving reveal v's seed. No honest device reveals both secrets of one device.
3. With the consistency check, each device signs the view it was shown; each is then sent the
   largest set of its neighbours' signatures whose views agree with its own (a device checks the
   signatures against the survivors it is sent, so disagreeing views cannot be shown together).
4. It rebuilds v's seed and H's mask keys from whatever answers came, and removes v's masks.

``attempt`` records the outcome: the recovered input (the attack worked) or why not. The session
then aborts, as a caught attacker's would.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

from tally.codec import ring_dtype, ring_mask, unpack
from tally.secagg import SecAggServer, SessionConfig, crypto, shamir
from tally.secagg.messages import (
    AdvertiseKeys,
    ConsistencyCheckRequest,
    ConsistencyCheckResponse,
    MaskedInputResponse,
    Outgoing,
    ShareDelivery,
    UnmaskRequest,
    UnmaskResponse,
)


@dataclasses.dataclass
class Attempt:
    victim: int | None  # None until the attacker picks one (``SplitViewServer``)
    ref: object = None
    masked_with: tuple[int, ...] = ()
    recovered: np.ndarray | None = None
    why_not: str = ""
    answers: int = 0
    attacked: bool = False  # the session got as far as the attack (past MaskedInput)
    # Set once the attacker has tried: the aggregator does so on its own thread, when the last
    # device answers or goes, which may be after the fleet has stopped.
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


class SplitViewServer(SecAggServer):
    """Attacks device ``victim`` (default: device 1) of every session it runs; ``attempts``
    (a class-level list unless given) collects one ``Attempt`` per session. With ``victim=None``
    it attacks the lowest-index device that got through ShareKeys: over the services a given
    device may be a straggler that the session leaves behind, and the attack needs a victim
    that is still in it."""

    attempts: list[Attempt] = []

    def __init__(self, config: SessionConfig, victim: int | None = 1, attempts: list[Attempt] | None = None) -> None:
        super().__init__(config)
        self.victim = victim
        self.attempt = Attempt(victim, config.ref)
        (self.attempts if attempts is None else attempts).append(self.attempt)
        self._advertised: dict[int, AdvertiseKeys] = {}
        self._masked: dict[str, bytes] = {}
        self._views: dict[int, frozenset[int]] = {}
        self._signatures: dict[int, bytes] = {}
        self._unmask: dict[int, UnmaskResponse] = {}
        self._attacking: str | None = None  # the phase the attacker runs itself
        self._pending: set[int] = set()
        self._sum_id = config.sums[0].sum_id

    # -- the server interface the aggregator drives ------------------------------------------

    @property
    def phase(self) -> str:
        return self._attacking or super().phase

    @property
    def finished(self) -> bool:
        return self._attacking is None and super().finished

    @property
    def awaiting(self) -> frozenset[int]:
        return frozenset(self._pending) if self._attacking else super().awaiting

    def receive(self, message) -> list[Outgoing]:
        if isinstance(message, AdvertiseKeys):
            self._advertised[message.sender] = message
        if isinstance(message, MaskedInputResponse) and message.sender == self.victim:
            self._masked[message.sum_id] = message.data
        if self._attacking:
            return self._attack_receive(message)
        return self._tamper(super().receive(message))

    def on_deadline(self) -> list[Outgoing]:
        if self._attacking:
            return self._next_attack_phase()
        return self._tamper(super().on_deadline())

    def device_lost(self, index: int) -> list[Outgoing]:
        if self._attacking:
            self._pending.discard(index)
            return self._next_attack_phase() if not self._pending else []
        return self._tamper(super().device_lost(index))

    # -- the attack --------------------------------------------------------------------------

    def _tamper(self, out: list[Outgoing]) -> list[Outgoing]:
        deliveries = [o.recipient for o in out if isinstance(o.message, ShareDelivery)]
        if self.victim is None and deliveries:
            self.victim = self.attempt.victim = min(deliveries)
        tampered = []
        for o in out:
            m = o.message
            if isinstance(m, ShareDelivery) and o.recipient == self.victim:
                senders = sorted({s.sender for s in m.shares})[: self.config.threshold]
                self.attempt.masked_with = tuple(senders)
                m = dataclasses.replace(m, shares=tuple(s for s in m.shares if s.sender in senders))
                o = Outgoing(o.recipient, m)
            if isinstance(m, (ConsistencyCheckRequest, UnmaskRequest)) and m.sum_id == self._sum_id:
                return self._begin([x.recipient for x in out])
            tampered.append(o)
        return tampered

    def _abort(self, reason, recipients):
        """Every way the session ends goes through here: the attempt is over, attacked or not."""
        if not self.attempt.attacked:
            self.attempt.why_not = f"the session ended before the attack: {reason}"
        self.attempt.done.set()
        return super()._abort(reason, recipients)

    def _begin(self, survivors: list[int]) -> list[Outgoing]:
        self.attempt.attacked = True
        config = self.config
        self._views = _split_views(config, self.victim, self.attempt.masked_with, survivors)
        ref, sum_id = config.ref, self._sum_id
        self._pending = set(survivors)
        if config.consistency_check:
            self._attacking = "consistency_check"
            return [Outgoing(i, ConsistencyCheckRequest(ref, sum_id, tuple(sorted(self._views[i]))))
                    for i in survivors]
        self._attacking = "unmask"
        return [Outgoing(i, UnmaskRequest(ref, sum_id, tuple(sorted(self._views[i])))) for i in survivors]

    def _attack_receive(self, message) -> list[Outgoing]:
        if isinstance(message, ConsistencyCheckResponse) and self._attacking == "consistency_check":
            self._signatures[message.sender] = message.signature
        elif isinstance(message, UnmaskResponse) and self._attacking == "unmask":
            self._unmask[message.sender] = message
        else:
            return []
        self._pending.discard(message.sender)
        return [] if self._pending else self._next_attack_phase()

    def _next_attack_phase(self) -> list[Outgoing]:
        if self._attacking == "consistency_check":
            self._attacking = "unmask"
            self._pending = set(self._signatures)
            return [Outgoing(i, self._signed_request(i)) for i in sorted(self._signatures)]
        self._recover()
        self._attacking = None
        return self._abort("split-view attacker gave up", self._views)

    def _signed_request(self, device: int) -> UnmaskRequest:
        """The survivors and signatures most likely to pass ``device``'s check: its own view
        merged with every neighbour's signed view that agrees with what is merged so far."""
        config = self.config
        status = {j: j in self._views[device] for j in _closed(config, device)}
        merged = []
        for j in config.neighbours(device).tolist():
            if j not in self._signatures or j not in self._views[device]:
                continue
            theirs = {x: x in self._views[j] for x in _closed(config, j)}
            if all(status.get(x, alive) == alive for x, alive in theirs.items()):
                status.update(theirs)
                merged.append((j, self._signatures[j]))
        survivors = tuple(sorted(x for x, alive in status.items() if alive))
        return UnmaskRequest(config.ref, self._sum_id, survivors, tuple(merged))

    def _recover(self) -> None:
        config, attempt, v = self.config, self.attempt, self.victim
        attempt.answers = len(self._unmask)
        t = config.threshold
        seed = _shares(self._unmask.values(), v, "seed")
        if len(seed) < t:
            attempt.why_not = f"{len(seed)} of t={t} shares of the victim's seed"
            return
        keys = {j: _shares(self._unmask.values(), j, "key") for j in attempt.masked_with}
        short = {j: len(s) for j, s in keys.items() if len(s) < t}
        if short:
            attempt.why_not = f"too few key shares of the victim's partners (owner: shares): {short}"
            return
        spec = config.sums[0]
        context = config.ref.context(spec.sum_id)
        vector = unpack(self._masked[spec.sum_id], spec.wire_bits, spec.dim).astype(ring_dtype(spec.bits))
        expander = crypto.MaskExpander(spec.dim, vector.dtype)
        expander.apply(vector, crypto.self_mask_key(_rebuild(seed, t), context), subtract=True)
        victim_public = self._advertised[v].keys[0].mask_public
        for j, shares in keys.items():
            key = crypto.pairwise_mask_key(crypto.ScalarKey(_rebuild(shares, t)).agree(victim_public), context)
            expander.apply(vector, key, subtract=v < j)  # v added the mask when v < j
        np.bitwise_and(vector, vector.dtype.type(ring_mask(spec.bits)), out=vector)
        attempt.recovered = vector


def _closed(config: SessionConfig, device: int) -> list[int]:
    return sorted([*config.neighbours(device).tolist(), device])


def _split_views(config: SessionConfig, victim: int, partners: tuple[int, ...],
                 survivors: list[int]) -> dict[int, frozenset[int]]:
    """Each survivor's view: its surviving neighbours (and itself) minus the members of
    ``partners`` it is told dropped. A max flow gives every partner t such devices among its
    neighbours, none dropping more than it can while still seeing t surviving neighbours."""
    t = config.threshold
    alive = set(survivors)
    others = [u for u in survivors if u != victim]
    col = {u: len(partners) + 1 + r for r, u in enumerate(others)}
    size = len(partners) + len(others) + 2
    source, sink = 0, size - 1
    rows, cols, caps = [], [], []
    for r, j in enumerate(partners, start=1):
        rows.append(source), cols.append(r), caps.append(t)
        for u in config.neighbours(j).tolist():
            if u in col:
                rows.append(r), cols.append(col[u]), caps.append(1)
    for u in others:
        room = len(alive.intersection(config.neighbours(u).tolist())) - t
        rows.append(col[u]), cols.append(sink), caps.append(max(room, 0))
    graph = csr_matrix((np.array(caps, dtype=np.int32), (rows, cols)), shape=(size, size))
    flow = maximum_flow(graph, source, sink).flow.tocoo()
    dropped: dict[int, set[int]] = {u: set() for u in survivors}
    by_col = {c: u for u, c in col.items()}
    for r, c, f in zip(flow.row, flow.col, flow.data):
        if f > 0 and 1 <= r <= len(partners) and c in by_col:
            dropped[by_col[c]].add(partners[r - 1])
    return {u: frozenset(j for j in _closed(config, u) if j in alive and j not in dropped[u])
            for u in survivors}


def _shares(answers, owner: int, kind: str) -> dict[int, bytes]:
    """Holder -> share of ``owner``'s seed or key, from the answers that name it."""
    out = {}
    for a in answers:
        owners, blob = (a.seed_owners, a.seed_shares) if kind == "seed" else (a.key_owners, a.key_shares)
        if owner in owners:
            at = list(owners).index(owner) * shamir.SHARE_BYTES
            out[a.sender] = blob[at : at + shamir.SHARE_BYTES]
    return out


def _rebuild(shares: dict[int, bytes], t: int) -> int:
    holders = sorted(shares)[:t]
    return shamir.reconstruct([holders], [[shamir.share_from_bytes(shares[h]) for h in holders]])[0]
