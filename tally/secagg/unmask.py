"""The Unmask phase's work, apart from its messages (``server._UnmaskPhase``): which secrets a sum
needs and what each survivor's answer must name (``NeededSecrets``), the shares gathered for them
(``ShareBook``), rebuilding and checking them (``SecretRebuilder``) and taking the masks off the
total (``remove_masks``). Sans-IO like the rest of the server.

Secrets are rows of fixed arrays (survivors' seeds, then the needed dropouts' keys) and each
answer is kept as one block of shares with the rows it fills, so a message costs a few vector
operations however many shares it carries, and the rebuild interpolates every secret in one
batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from tally.codec import ring_mask
from tally.secagg import crypto, shamir
from tally.secagg.config import SessionConfig
from tally.secagg.messages import AdvertiseKeys

SHARE = np.dtype((np.void, shamir.SHARE_BYTES))  # one share, a little-endian scalar, as one element

Secret = tuple[str, int]  # ("seed", survivor) or ("key", dropout)


def scalars(shares: np.ndarray) -> list[int]:
    """The scalars of SHARE elements; one out of range makes a secret that fails its check."""
    return [int.from_bytes(share, "little") for share in shares.tolist()]


def indicator(n: int, devices: Iterable[int]) -> np.ndarray:
    """Boolean lookup table over device indices 0..n."""
    table = np.zeros(n + 1, dtype=bool)
    table[list(devices)] = True
    return table


class ExpectedAnswers:
    """What each expected Unmask answer must name, computed for all senders in one vectorised
    pass: its surviving neighbours (seeds), its dropped neighbours (keys), ascending, and the
    secret rows those fill in that order; and what its UnmaskRequest lists: the sender and its
    surviving neighbours, ascending (a device needs only its own neighbourhood's status)."""

    def __init__(self, owners: list[int], rows: np.ndarray,
                 spans: dict[int, tuple[int, int, int, int, int]]) -> None:
        self._owners, self._rows, self._spans = owners, rows, spans

    def status(self, sender: int) -> tuple[int, ...]:
        start, _, split, _, _ = self._spans[sender]
        return tuple(self._owners[start:split])

    def of(self, sender: int) -> tuple[tuple[int, ...], tuple[int, ...], np.ndarray]:
        """(seed owners, key owners, rows) of ``sender``'s answer."""
        start, me, split, end, row = self._spans[sender]
        owners = self._owners
        seeds = tuple(owners[start:me] + owners[me + 1 : split])
        return seeds, tuple(owners[split:end]), self._rows[row : row + end - start - 1]


def expected_answers(config: SessionConfig, senders: list[int], is_survivor: np.ndarray,
                     is_dropped: np.ndarray, row_of: np.ndarray) -> ExpectedAnswers:
    """Senders are survivors: each sorts among its own surviving neighbours."""
    if not senders:
        return ExpectedAnswers([], np.zeros(0, dtype=np.int64), {})
    me = np.asarray(senders, dtype=np.int64)
    block = np.concatenate([config.neighbour_rows(me), me[:, None]], axis=1)
    # Seeds sort before keys, neighbours of neither kind (pruned before ShareKeys) last.
    span = config.n + 1
    order = np.where(is_survivor[block], block, np.where(is_dropped[block], span + block, 2 * span))
    order.sort(axis=1)
    named = order < 2 * span
    owners = order[named] % span
    ends = np.cumsum(np.count_nonzero(named, axis=1))
    splits = ends - np.count_nonzero(named & (order >= span), axis=1)
    starts = np.concatenate([[0], ends[:-1]])
    is_me = owners == np.repeat(me, ends - starts)
    spans = dict(zip(senders, zip(starts.tolist(), np.flatnonzero(is_me).tolist(), splits.tolist(),
                                  ends.tolist(), (starts - np.arange(len(me))).tolist())))
    return ExpectedAnswers(owners.tolist(), row_of[owners[~is_me]], spans)


def with_surviving_neighbour(config: SessionConfig, dropped: frozenset[int],
                             is_survivor: np.ndarray) -> frozenset[int]:
    """The dropped devices with at least one surviving neighbour: their pairwise masks remain."""
    rows = np.fromiter(sorted(dropped), dtype=np.int64, count=len(dropped))
    if not len(rows):
        return frozenset()
    return frozenset(rows[is_survivor[config.neighbour_rows(rows)].any(axis=1)].tolist())


class NeededSecrets:
    """The secrets one sum's Unmask rebuilds, as rows: every survivor's seed, then the mask key
    of every dropout with a surviving neighbour (only those left masks behind); and what each
    answering survivor must send of them (``expect``)."""

    def __init__(self, config: SessionConfig, survivors: frozenset[int], dropped: frozenset[int],
                 answering: Iterable[int]) -> None:
        is_survivor = indicator(config.n, survivors)
        needed_keys = with_surviving_neighbour(config, dropped, is_survivor)
        self.rows: list[Secret] = (
            [("seed", i) for i in sorted(survivors)] + [("key", j) for j in sorted(needed_keys)]
        )
        # Row of each owner's secret: its seed if it survived, its key if it dropped (nobody is
        # both); -1: nothing of it is needed.
        self.row_of = np.full(config.n + 1, -1, dtype=np.int64)
        self.row_of[[owner for _, owner in self.rows]] = np.arange(len(self.rows))
        self.expect = expected_answers(config, sorted(answering), is_survivor,
                                       indicator(config.n, dropped), self.row_of)


class ShareBook:
    """The shares received for each secret row, and how many each still waits for: t, or more
    once a rebuilt secret failed its check."""

    def __init__(self, secrets: int, threshold: int) -> None:
        self.threshold = threshold
        self.counts = np.zeros(secrets, dtype=np.int64)
        self.wanted = np.full(secrets, threshold, dtype=np.int64)
        # Per answer, in arrival order: its sender, the rows it fills, its m shares and how many
        # shares of each row came before (the rebuild takes each secret's first t from these).
        self._answers: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []
        # Every secret can have its wanted shares only once this many shares have arrived; past
        # that, each answer re-reads only the secrets still short at the previous one.
        self._shares_in = 0
        self._shares_wanted = int(self.wanted.sum())
        self._short: np.ndarray | None = None

    def add(self, sender: int, rows: np.ndarray, shares: np.ndarray) -> None:
        """``sender``'s shares (SHARE elements) of ``rows``, each row once."""
        before = self.counts[rows]
        self.counts[rows] = before + 1
        self._answers.append((sender, rows, shares, before))
        self._shares_in += len(rows)

    def have_wanted(self) -> bool:
        if self._shares_in < self._shares_wanted:
            return False
        short = self._short
        if short is None:
            short = np.flatnonzero(self.counts < self.wanted)
        else:
            short = short[self.counts[short] < self.wanted[short]]
        self._short = short
        return not short.size

    def below_threshold(self) -> np.ndarray:
        """The rows with fewer than t shares: they cannot be rebuilt at all."""
        return np.flatnonzero(self.counts < self.threshold)

    def want_more(self, rows: list[int]) -> None:
        """Wait for one more holder's share of each of ``rows``: more shares decode around wrong ones."""
        self.wanted[rows] = self.counts[rows] + 1
        self._shares_wanted = int(self.wanted.sum())
        self._short = None

    def held(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every share received, in arrival order: (rows, holders, shares (m,) of SHARE)."""
        answers = self._answers
        rows = np.concatenate([a[1] for a in answers])
        holders = np.repeat([a[0] for a in answers], [len(a[1]) for a in answers])
        return rows, holders, np.concatenate([a[2] for a in answers])

    def first_t(self, pending: np.ndarray, suspects: Iterable[int], rows: np.ndarray, holders: np.ndarray,
                shares: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """t holders (S, t) and their shares (S, t) of SHARE for each pending row, each of which has at
        least t shares: the first t to answer, or, once someone was caught lying (``suspects``),
        holders never caught first. One gather each, from where every chosen share goes."""
        t = self.threshold
        suspects = list(suspects)
        if suspects:
            suspect = np.isin(holders, suspects)
            order = np.lexsort((suspect, rows))  # stable: arrival order among equals
            # Each row's entries are contiguous in `order`: a share's rank is its place among them.
            rank = np.empty(len(order), dtype=np.int64)
            rank[order] = np.arange(len(order)) - (np.cumsum(self.counts) - self.counts)[rows[order]]
        else:
            rank = np.concatenate([a[3] for a in self._answers])
        keep = np.flatnonzero((rank < t) & pending[rows])
        slot = np.cumsum(pending) - 1  # a pending row's place among the pending rows
        source = np.empty(len(keep), dtype=np.intp)
        source[slot[rows[keep]] * t + rank[keep]] = keep
        return holders[source].reshape(-1, t), shares[source].reshape(-1, t)


class SecretRebuilder:
    """Rebuilds one sum's secrets from a ``ShareBook`` and keeps those that match what their
    owners committed to in their signed keys (both scalars, each fixed up to sign: its commitment
    is the u-coordinate of scalar * B). Holders caught sending a wrong share go into
    ``misbehaving``, whose shares are then used last."""

    def __init__(self, config: SessionConfig, sum_id: str, position: int, secrets: list[Secret],
                 advertised: Mapping[int, AdvertiseKeys], misbehaving: dict[int, str]) -> None:
        self.sum_id, self.position, self.secrets = sum_id, position, secrets
        self._threshold = config.threshold
        self._advertised, self._misbehaving = advertised, misbehaving
        self.rebuilt: dict[int, int] = {}

    def rebuild(self, book: ShareBook) -> list[int]:
        """Rebuild every secret not yet rebuilt; the rows that cannot be rebuilt and checked yet.

        The common case costs one batched interpolation over t shares per secret and one check
        per secret; only a secret that fails its check is decoded from all of its shares, which
        also names the holders whose shares were wrong.
        """
        pending = np.ones(len(self.secrets), dtype=bool)
        pending[list(self.rebuilt)] = False
        held = book.held()
        holders, shares = book.first_t(pending, self._misbehaving, *held)
        secrets = shamir.reconstruct(holders.tolist(), [scalars(row) for row in shares])
        failed = []
        for row, secret in zip(np.flatnonzero(pending).tolist(), secrets):
            if self._checked(row, secret):
                self.rebuilt[row] = secret
            elif not self._decode(row, *held):
                failed.append(row)
        return failed

    def _decode(self, row: int, rows: np.ndarray, holders: np.ndarray, shares: np.ndarray) -> bool:
        mine = np.flatnonzero(rows == row)
        mine = mine[np.argsort(holders[mine])]
        try:
            secret, wrong = shamir.decode(holders[mine].tolist(), scalars(shares[mine]), self._threshold)
        except ValueError:
            return False
        if not self._checked(row, secret):
            return False
        self.rebuilt[row] = secret
        kind, owner = self.secrets[row]
        for holder in wrong:
            self._misbehaving[holder] = f"wrong {kind} share of device {owner} in sum {self.sum_id!r}"
        return True

    def _checked(self, row: int, secret: int) -> bool:
        """Whether the rebuilt scalar is the one its owner committed to in its signed keys: the
        mask key's commitment is its X25519 public key, the seed's its ``seed_commitment``."""
        kind, owner = self.secrets[row]
        keys = self._advertised[owner].keys[self.position]
        committed = keys.seed_commitment if kind == "seed" else keys.mask_public
        return secret != 0 and crypto.public_of_scalar(secret) == committed

    def by_owner(self) -> tuple[dict[int, int], dict[int, int]]:
        """The rebuilt survivors' seeds and dropouts' mask keys (scalars), by owner."""
        seeds: dict[int, int] = {}
        keys: dict[int, int] = {}
        for row, secret in self.rebuilt.items():
            kind, owner = self.secrets[row]
            (seeds if kind == "seed" else keys)[owner] = secret
        return seeds, keys


def remove_masks(config: SessionConfig, position: int, masked: np.ndarray, survivors: frozenset[int],
                 seeds: Mapping[int, int], keys: Mapping[int, int],
                 advertised: Mapping[int, AdvertiseKeys]) -> np.ndarray:
    """The sum: ``masked`` (the survivors' masked inputs, summed as they arrived; modified in
    place) less each survivor's self mask and each dropout's pairwise masks with survivors."""
    assert not (set(seeds) & set(keys)), "a device's seed and key were both reconstructed"
    spec = config.sums[position]
    context = config.ref.context(spec.sum_id)
    total = masked
    dtype = total.dtype
    expander = crypto.MaskExpander(spec.dim, dtype)
    for seed in seeds.values():
        expander.apply(total, crypto.self_mask_key(seed, context), subtract=True)
    for j, scalar in keys.items():
        key_of_j = crypto.ScalarKey(scalar)
        for i in config.neighbours(j):
            i = int(i)
            if i not in survivors:
                continue
            peer = advertised[i].keys[position].mask_public
            key = crypto.pairwise_mask_key(key_of_j.agree(peer), context)
            # Device i added the mask when i < j and subtracted it otherwise.
            expander.apply(total, key, subtract=i < j)
    np.bitwise_and(total, dtype.type(ring_mask(spec.bits)), out=total)
    return total
