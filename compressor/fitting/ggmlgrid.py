"""ggml's grids, read off gguf-py's reference decoder, never written per type (:func:`layout`).

* **bits**: flip each bit of a quantized probe block; a bit that changes exactly one element is one of
  that element's code bits, any other is a scale or min bit and is kept. An element's bits are ordered by
  the change each makes from the all-clear code (the least is the least significant): right for affine
  codes, inverted bits (Q3_K's hmask) and monotonic tables (IQ4's ``kvalues``) alike;
* **levels**: an element's value at code ``c`` is ``base + step · T[c]``: ``base`` its value at code 0,
  ``step`` its value at code 1 minus ``base``, ``T`` one table per type. The model is checked on the
  probes at every code and the type refused where it does not hold.

What :mod:`.gridround` rounds onto, code by code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from compressor.core import ggml
from compressor.core.ggml import BLOCKS, GGMLType

#: Probe blocks the bit discovery must agree on: a scale bit could pass for a code bit in one probe
#: whose sub-block has a single non-zero code, not in all of them.
_PROBES = 4

#: The fewest code bits an element must own. IQ2/IQ3 grids keep only a sign per element; their
#: magnitudes are indices shared by groups of elements, which are not a per-element grid (:mod:`.gridround`
#: compensates them block by block instead).
_MIN_BITS = 2


@dataclass(frozen=True, eq=False)
class Layout:
    """Where each element's code sits in one block of a GGML type, and the type's level table."""

    qtype: GGMLType
    block: int
    """Elements per block."""
    nbytes: int
    """Bytes per block."""
    bits: np.ndarray
    """``[block, k]``: each element's code bits as ``byte · 8 + bit``, least significant first."""
    table: np.ndarray
    """``[2**k]`` float64: ``T[c]``, an element's value at code ``c`` being ``base + step · T[c]``."""

    @property
    def width(self) -> int:
        """Code bits per element."""
        return self.bits.shape[1]

    @functools.cached_property
    def _mask(self) -> np.ndarray:
        """``[nbytes]`` uint8: the code bits of one block set."""
        mask = np.zeros(self.nbytes, dtype=np.uint8)
        np.bitwise_or.at(mask, self.bits.ravel() // 8, (1 << (self.bits.ravel() % 8)).astype(np.uint8))
        return mask

    def _blocks(self, raw: np.ndarray) -> np.ndarray:
        raw = np.asarray(raw, dtype=np.uint8)
        if raw.shape[-1] % self.nbytes:
            raise ValueError(f"{raw.shape[-1]} bytes per row are not a whole number of {self.qtype.name} "
                             f"blocks of {self.nbytes} bytes")
        return raw.reshape(-1, self.nbytes)

    def unpack(self, raw: np.ndarray) -> np.ndarray:
        """Every element's code, ``[rows, n]`` uint8, from raw bytes ``[rows, row_bytes]``."""
        raw = np.asarray(raw, dtype=np.uint8)
        planes = np.unpackbits(self._blocks(raw), axis=1, bitorder="little")[:, self.bits]  # [blocks, block, k]
        codes = np.packbits(planes, axis=-1, bitorder="little")[..., 0]
        return codes.reshape(raw.shape[0] if raw.ndim > 1 else 1, -1)

    def pack(self, raw: np.ndarray, codes: np.ndarray | int) -> np.ndarray:
        """A copy of ``raw`` with every element's code set to ``codes`` (``[rows, n]``, or one code for
        all); every other bit as it was."""
        raw = np.asarray(raw, dtype=np.uint8)
        blocks = self._blocks(raw)
        c = np.asarray(codes)
        if c.ndim == 0:  # one pattern for every block
            one = np.zeros((1, self.nbytes), dtype=np.uint8)
            pattern = self.pack(one, np.full(self.block, int(c)))
            return ((blocks & ~self._mask) | pattern).reshape(raw.shape)
        if c.size != blocks.shape[0] * self.block:
            raise ValueError(f"{c.size} codes for {blocks.shape[0] * self.block} elements")
        planes = np.unpackbits(blocks, axis=1, bitorder="little")
        planes[:, self.bits] = np.unpackbits(c.astype(np.uint8).reshape(-1, self.block, 1), axis=-1,
                                             count=self.width, bitorder="little")
        return np.packbits(planes, axis=1, bitorder="little").reshape(raw.shape)

    def grid(self, raw: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``(base, step)``, float64 ``[rows, n]``: every element's level at code 0 and the step to code 1
        under the scales in ``raw``, by two dequantizations."""
        base = ggml.dequantize(self.pack(raw, 0), self.qtype, n).astype(np.float64)
        with np.errstate(invalid="ignore"):  # inf − inf where ggml's fp16 scale overflowed
            return base, ggml.dequantize(self.pack(raw, 1), self.qtype, n) - base

    def values(self, base: np.ndarray, step: np.ndarray, codes: np.ndarray) -> np.ndarray:
        """float32 levels at ``codes``: what gguf-py (and ggml) decode them to."""
        return (base + step * self.table[codes]).astype(np.float32)


def _decode(blocks: np.ndarray, t: GGMLType) -> np.ndarray:
    import gguf.quants

    with np.errstate(all="ignore"):  # a flipped exponent bit decodes to inf or nan: a change like any other
        return np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(int(t))), dtype=np.float64)


def _refuse(t: GGMLType, why: str) -> ValueError:
    return ValueError(f"{t.name} cannot be rounded onto its own grid: {why}")


def _flips(nbytes: int) -> np.ndarray:
    """``[8·nbytes, nbytes]``: row ``b`` sets bit ``b`` alone."""
    b = np.arange(8 * nbytes)
    out = np.zeros((b.size, nbytes), dtype=np.uint8)
    out[b, b // 8] = 1 << (b % 8)
    return out


def _owners(t: GGMLType, probes: np.ndarray) -> np.ndarray:
    """Each bit's element where flipping it changes that element alone, on every probe; −1 elsewhere."""
    flips = _flips(probes.shape[1])
    owner = None
    for p in probes:
        changed = _decode(p ^ flips, t) != _decode(p[None], t)  # nan != nan: counted as changed
        mine = np.where(changed.sum(1) == 1, changed.argmax(1), -1)
        owner = mine if owner is None else np.where(owner == mine, owner, -1)
        if np.bincount(owner[owner >= 0], minlength=probes.shape[1]).max(initial=0) < _MIN_BITS:
            break  # more probes only take bits away
    return owner


def _significance(t: GGMLType, probes: np.ndarray, owner: np.ndarray, k: int) -> np.ndarray:
    """``[block, k]``: each element's code bits, ordered by the change each makes to it from the all-clear
    code (least first), which must be distinct and the same on every probe."""
    pos = np.flatnonzero(owner >= 0)
    flips = _flips(probes.shape[1])
    clear = probes & ~np.bitwise_or.reduce(flips[pos], axis=0)
    block = BLOCKS[t][0]
    bits = np.empty((block, k), dtype=np.int64)
    for j, c in enumerate(clear):
        delta = np.abs(_decode(c ^ flips[pos], t)[np.arange(pos.size), owner[pos]]
                       - _decode(c[None], t)[0, owner[pos]])
        for e in range(block):
            mine = owner[pos] == e
            rank = np.argsort(delta[mine], kind="stable")
            mags = delta[mine][rank]
            if not (np.isfinite(mags).all() and (np.diff(mags) > 0).all()):
                raise _refuse(t, f"element {e}'s code bits do not change it by distinct amounts ({mags})")
            if j and not np.array_equal(bits[e], pos[mine][rank]):
                raise _refuse(t, f"element {e}'s code bits rank differently on two probe blocks")
            bits[e] = pos[mine][rank]
    return bits


def _table(t: GGMLType, probes: np.ndarray, bits: np.ndarray, rng: np.random.Generator) -> Layout:
    """The layout with its level table ``T``, read off the probes at every code and checked exactly there
    (every element at one code, and every element at its own random code)."""
    block, nbytes = BLOCKS[t]
    k = bits.shape[1]
    draft = Layout(t, block, nbytes, bits, np.zeros(0))
    levels = np.stack([_decode(draft.pack(probes, c), t) for c in range(2 ** k)], 1)  # [probes, codes, block]
    base, step = levels[:, :1], levels[:, 1:2] - levels[:, :1]
    if (step == 0).any():
        raise _refuse(t, "a probe element does not move between codes 0 and 1")
    table = np.median((levels - base) / step, axis=(0, 2))
    if np.allclose(table, np.round(table), rtol=0, atol=1e-6):
        table = np.round(table)
    lay = Layout(t, block, nbytes, bits, table)
    mixed = rng.integers(0, 2 ** k, size=(probes.shape[0], block))
    if not (np.array_equal(lay.values(base, step, np.arange(2 ** k)[None, :, None]), levels.astype(np.float32))
            and np.array_equal(lay.values(base[:, 0], step[:, 0], mixed),
                               _decode(lay.pack(probes, mixed), t).astype(np.float32))):
        raise _refuse(t, "an element's value is not base + step·T[code] with one table T for the type")
    return lay


@functools.lru_cache(maxsize=None)
def _discover(t: GGMLType) -> Layout | str:
    if not t.quantized:
        return str(_refuse(t, "a float type stores values, not codes on a grid"))
    block = BLOCKS[t][0]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((_PROBES, block)) * rng.uniform(0.2, 2.0, (_PROBES, block))
    x += rng.uniform(-0.5, 0.5, (_PROBES, 1))  # an offset, so the mins of affine types are not zero
    probes = ggml.quantize(x.astype(np.float32), t, np.ones(block, dtype=np.float32))
    owner = _owners(t, probes)
    counts = np.bincount(owner[owner >= 0], minlength=block)
    try:
        if counts.min() != counts.max():
            raise _refuse(t, f"its elements own between {counts.min()} and {counts.max()} code bits (bits that "
                             f"change that element alone); a grid needs the same number for every element")
        k = int(counts[0])
        if k < _MIN_BITS:
            raise _refuse(t, f"each element owns {k} bit(s) only; the rest of its level is an index shared "
                             f"with other elements, not a per-element grid")
        if k > 8:
            raise _refuse(t, f"codes of {k} bits (at most 8 are handled)")
        return _table(t, probes, _significance(t, probes, owner, k), rng)
    except ValueError as exc:
        return str(exc)


def layout(qtype: GGMLType) -> Layout:
    """The code layout and level table of ``qtype``, discovered once from gguf-py's decoder; raises
    ``ValueError`` naming the type when its elements do not have a grid of their own."""
    found = _discover(GGMLType(qtype))
    if isinstance(found, str):
        raise ValueError(found)
    return found


def supports(qtype: GGMLType) -> str | None:
    """Why ``qtype`` cannot be rounded here, or None when it can (needs gguf and llama-cpp-python).

    >>> supports(GGMLType.Q4_K) is None   # doctest: +SKIP
    True
    """
    try:
        layout(qtype)
    except ImportError as exc:
        return f"needs gguf and llama-cpp-python ({exc})"
    except ValueError as exc:
        return str(exc)
    return None
