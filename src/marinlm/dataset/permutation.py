"""A seeded pseudo-random permutation of [0, n) computed index by index, in constant memory.

The loader draws the rows of an epoch in a shuffled order. Holding that order as an array would
take 8 bytes a row: 35 GB for one pass over the hero run's 18T tokens at 4,096 a row. Instead a
row's position is computed on demand by a Feistel network (Luby-Rackoff): on a domain of 4^h >= n
values, split x into two h-bit halves and run a few rounds of (L, R) -> (R, L xor F(R, key_i)),
with F a 64-bit integer mixer. Each round is invertible whatever F is, so the network is a bijection
of [0, 4^h). Values that land in [n, 4^h) are walked on through the network until they fall inside
[0, n) ("cycle walking"), which keeps it a bijection of [0, n); as 4^h < 4n, that takes under four
passes on average.

Shape legend: N indices.
"""

from __future__ import annotations

import numpy as np

_ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64's mixing constants


def _mix(x_N: np.ndarray, key: np.uint64) -> np.ndarray:
    z = x_N ^ key
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class Permutation:
    """`Permutation(n, seed)(i)` is where index i goes; a bijection of [0, n) for every seed.

    `seed` is anything `np.random.default_rng` takes (an int, a list of ints).
    """

    def __init__(self, n: int, seed):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        self.half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half_bits) - 1)
        keys = np.random.default_rng(seed).integers(0, 2**63, size=_ROUNDS, dtype=np.int64)
        self.keys = [np.uint64(k) for k in keys]

    def _network(self, x_N: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half_bits)
        left, right = x_N >> h, x_N & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right, key) & self.mask)
        return (left << h) | right

    def __call__(self, index):
        """Where `index` (an int or an integer array, each in [0, n)) goes, in the same form."""
        x_N = np.atleast_1d(np.asarray(index, dtype=np.int64))
        if x_N.size and (x_N.min() < 0 or x_N.max() >= self.n):
            raise IndexError(f"permutation of [0, {self.n}): index out of range")
        x_N = x_N.astype(np.uint64)
        with np.errstate(over="ignore"):  # the mixer's products are meant to wrap modulo 2^64
            outside = np.ones(x_N.shape, dtype=bool)
            while outside.any():
                x_N[outside] = self._network(x_N[outside])
                outside = x_N >= np.uint64(self.n)
        out = x_N.astype(np.int64)
        return int(out[0]) if np.ndim(index) == 0 else out
