"""The SecAgg+ random Harary graph: who shares keys with whom."""

from __future__ import annotations

import numpy as np

SEED_BYTES = 32


class HararyGraph:
    """n nodes on a ring in a seed-derived random order, each joined to the k/2 nearest per side.

    The order only has to be unpredictable before devices commit to their keys, not secret: the
    graph is public, so PCG64 seeded from the public seed is enough, and every party derives the
    same graph from the seed alone. ``k == n - 1`` is the full graph (any parity).
    """

    def __init__(self, n: int, k: int, seed: bytes) -> None:
        if n < 2:
            raise ValueError(f"a graph needs at least 2 nodes, got n={n}")
        if not 1 <= k <= n - 1:
            raise ValueError(f"k={k} must lie in [1, n-1={n - 1}]")
        if k % 2 and k != n - 1:
            raise ValueError(f"k={k} must be even unless it is n-1={n - 1} (the full graph)")
        if len(seed) != SEED_BYTES:
            raise ValueError(f"seed must be {SEED_BYTES} bytes, got {len(seed)}")
        self.n = n
        self.k = k
        rng = np.random.Generator(np.random.PCG64(int.from_bytes(seed, "big")))
        self._ring = rng.permutation(n)  # ring position -> node
        self._position = np.empty(n, dtype=np.int64)  # node -> ring position
        self._position[self._ring] = np.arange(n)
        half = k // 2
        self._offsets = np.concatenate([np.arange(-half, 0), np.arange(1, half + 1)])

    @property
    def full(self) -> bool:
        return self.k == self.n - 1

    def table(self) -> np.ndarray:
        """(n, k): row i is ``neighbours(i)``, every row built in one vectorised step."""
        return self.rows(np.arange(self.n))

    def rows(self, nodes: np.ndarray) -> np.ndarray:
        """(len(nodes), k): row r is ``neighbours(nodes[r])``, built in one vectorised step."""
        nodes = np.asarray(nodes, dtype=np.int64)
        if self.full:
            others = np.arange(self.n - 1)[None, :]
            return others + (others >= nodes[:, None])
        return np.sort(self._ring[(self._position[nodes, None] + self._offsets[None, :]) % self.n], axis=1)

    def ball_rows(self, nodes: np.ndarray, radius: int) -> np.ndarray:
        """(len(nodes), m): row r holds, ascending, every node within ``radius`` hops of
        ``nodes[r]``, itself included (on the ring: the ``radius * k/2`` nearest per side)."""
        nodes = np.asarray(nodes, dtype=np.int64)
        reach = radius * (self.k // 2)
        if self.full or 2 * reach + 1 >= self.n:
            return np.broadcast_to(np.arange(self.n), (len(nodes), self.n))
        offsets = np.arange(-reach, reach + 1)
        return np.sort(self._ring[(self._position[nodes, None] + offsets[None, :]) % self.n], axis=1)

    def neighbours(self, i: int) -> np.ndarray:
        """Sorted ids of the k nodes that hold node ``i``'s shares (never ``i`` itself)."""
        if not 0 <= i < self.n:
            raise IndexError(f"node {i} outside [0, {self.n})")
        if self.full:
            return np.delete(np.arange(self.n), i)
        return np.sort(self._ring[(self._position[i] + self._offsets) % self.n])
