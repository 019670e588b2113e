"""Data parallelism on ``torch.distributed``: each rank calibrates and evaluates a shard.

Launched by ``torchrun`` or ``accelerate launch`` (``WORLD_SIZE`` > 1 in the
environment), the CLI calls :func:`init_from_env`; without a launcher nothing
here communicates and every helper degenerates to the single-process case.

**One canonical reduction order.** Floating-point sums depend on their order,
so a W-rank run equals a 1-process run bit for bit only if both merge the
per-batch partial statistics in the same order. That order is a balanced
binary tree over the batch indices (``mid = (lo + hi) // 2``): a single process
merges its batches in that tree order as they stream by (:class:`TreeReduce`
keeps one partial per tree level, like a binary counter); with W ranks the
nodes at depth ``ceil(log2 W)`` are dealt out as contiguous batch ranges (one
whole subtree per rank when W is a power of two), every rank merges its
subtrees the same way, and the subtree partials are exchanged with
``all_gather`` (exact bits) and merged in the same tree order on every rank.
The result does not depend on W (given the same batches and the same
intra-op thread count, which makes each batch's forward bitwise the same).

Per-window and per-batch quantities are gathered into full vectors in window / batch order, so every rank does
the same arithmetic on the same numbers (docs/distributed.md).
"""

from __future__ import annotations

import logging
import math
import os
from datetime import timedelta
from typing import Callable, Generic, TypeVar

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Collective timeout: rank 0 alone writes and verifies the checkpoint while the
#: other ranks wait, which for a large model takes longer than torch's default.
TIMEOUT = timedelta(hours=2)


class RankFailed(RuntimeError):
    """Raised on the other ranks when rank 0 failed in a step it runs alone (writing)."""

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(f"rank 0 failed: {message}")
        self.exit_code = exit_code


# -- who am I -------------------------------------------------------------------


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def init_from_env(device: str = "cpu") -> str:
    """Join the process group a launcher describes in the environment; returns the device to use.

    Does nothing unless ``WORLD_SIZE`` > 1 and no default group exists yet. The
    backend is gloo for CPU and nccl for CUDA, where each rank takes the GPU
    ``LOCAL_RANK`` (so ``cuda`` means "this rank's GPU").
    """
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        raise ValueError(f"WORLD_SIZE must be an integer, got {os.environ['WORLD_SIZE']!r}") from e
    if world <= 1 or not dist.is_available():
        return device
    cuda = str(device).startswith("cuda")
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=TIMEOUT)
        logger.info("rank %d of %d (%s)", dist.get_rank(), dist.get_world_size(), dist.get_backend())
    return device


def record_failure(exit_code: int, message: str) -> None:
    """Under ``torchrun``, say this rank's failure where torchrun's own report of it shows it: the error file
    it names in ``TORCHELASTIC_ERROR_FILE`` (its "traceback" line then carries ``message`` and the exit code,
    where it would say "To enable traceback see …"). Nothing without a launcher, or when the file cannot be
    written (the rank still exits with ``exit_code``)."""
    import json
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or not exit_code:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"message": f"{message} (compressor exit code {exit_code})", "timestamp": int(time.time())}, f)
    except OSError:
        pass


def launch(nproc: int, argv: list[str]) -> int:
    """Run ``python -m compressor ARGV`` on ``nproc`` ranks of this machine, as ``torchrun --standalone
    --nproc-per-node NPROC -m compressor ARGV`` does, and return the run's exit code: the first failed rank's
    (rank 0's where it failed first; 128 + the signal for a rank a signal stopped), 0 when every rank succeeded.
    torchrun itself exits 1 with its own traceback whatever the ranks' codes; the ranks said why already."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(["--standalone", "--nproc-per-node", str(nproc), "-m", "compressor", *argv])
    # torch's agent logs every failed rank and the error files it copies: the ranks said it, once
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        torchrun.run(args)
    except ChildFailedError as failed:
        codes = {r: f.exitcode for r, f in failed.failures.items()}
        first = failed.get_first_failure()[0]
        code = codes[0] if codes.get(0, 0) > 0 else codes[first]  # a sibling stopped after it shows a signal
        return code if code > 0 else 128 - code
    return 0


# -- exchanging -------------------------------------------------------------------


def all_gather_objects(obj) -> list:
    """``obj`` of every rank, in rank order (tensors arrive with their exact bits).

    The CPU tensors in ``obj`` travel as raw bytes in one tensor collective, the rest pickled beside them
    (:class:`_TensorsApart`): a layer's input moments (Qwen2.5-1.5B: 350 MB) gathered through pickling alone took
    3–7 × as long on gloo. The same tensor object met twice arrives as one object; distinct views of one storage
    arrive as distinct tensors. Tensors should be on the CPU: a CUDA tensor would unpickle on the sender's
    device index."""
    if world_size() == 1:
        return [obj]
    local = _TensorsApart.pack(obj)
    heads = [None] * world_size()
    dist.all_gather_object(heads, local.head)
    longest = max(h[2] for h in heads)
    if longest == 0:
        return [_TensorsApart.unpack(h, None) for h in heads]
    mine = local.fill(torch.zeros(longest, dtype=torch.uint8))
    del local
    if dist.get_backend() == "nccl":
        mine = mine.to(torch.device("cuda", torch.cuda.current_device()))
    bufs = [torch.empty_like(mine) for _ in heads]
    dist.all_gather(bufs, mine)
    del mine
    out = []
    for r, h in enumerate(heads):  # each sender's buffer freed once its tensors are copied out
        out.append(_TensorsApart.unpack(h, bufs[r].cpu()))
        bufs[r] = None
    return out


class _TensorsApart:
    """An object pickled with its CPU tensors set apart (``persistent_id``), to travel as one flat byte buffer:
    ``head`` is ``(pickled bytes, [(dtype, shape, offset)], buffer bytes)``, :meth:`fill` writes the buffer;
    :meth:`unpack` rebuilds the object from a head and the sender's buffer, each tensor copied out of it (offsets
    aligned to :data:`ALIGN` bytes)."""

    ALIGN = 64

    def __init__(self, head: tuple, tensors: list[torch.Tensor]) -> None:
        self.head, self.tensors = head, tensors

    @classmethod
    def pack(cls, obj) -> "_TensorsApart":
        import io
        import pickle

        tensors: list[torch.Tensor] = []
        index: dict[int, int] = {}

        class Out(pickle.Pickler):
            def persistent_id(self, o):
                if type(o) is not torch.Tensor or o.device.type != "cpu" or o.requires_grad or o.is_sparse:
                    return None
                if id(o) not in index:
                    index[id(o)] = len(tensors)
                    tensors.append(o)
                return index[id(o)]

        data = io.BytesIO()
        Out(data, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        specs, offset = [], 0
        for t in tensors:
            specs.append((t.dtype, tuple(t.shape), offset))
            offset += -(-t.numel() * t.element_size() // cls.ALIGN) * cls.ALIGN
        return cls((data.getvalue(), specs, offset), tensors)

    def fill(self, buf: torch.Tensor) -> torch.Tensor:
        """The tensors' bytes written into ``buf`` (uint8, at least ``head[2]`` long) at their offsets."""
        for t, (_, _, at) in zip(self.tensors, self.head[1]):
            n = t.numel() * t.element_size()
            if n:
                buf[at:at + n] = t.detach().contiguous().reshape(-1).view(torch.uint8)
        return buf

    @staticmethod
    def unpack(head: tuple, buf: torch.Tensor | None):
        import io
        import pickle

        data, specs, _ = head
        made: dict[int, torch.Tensor] = {}

        class In(pickle.Unpickler):
            def persistent_load(self, pid):
                if pid not in made:
                    dtype, shape, at = specs[pid]
                    n = math.prod(shape) * dtype.itemsize
                    # a tensor of its own (a view of the buffer would keep all of it alive, and torch.save
                    # refuses views of one storage as several dtypes)
                    made[pid] = buf[at:at + n].view(dtype).reshape(shape).clone()
                return made[pid]

        return In(io.BytesIO(data)).load()


def broadcast_object(obj=None):
    """Rank 0's ``obj`` on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def from_main(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 only and hand its result to every rank (e.g. sampled text).

    An exception on rank 0 is re-raised there and reported on the others, so no rank waits forever."""
    if world_size() == 1:
        return fn()
    if is_main():
        try:
            value = fn()
        except BaseException as e:
            broadcast_object(("error", f"{type(e).__name__}: {e}"))
            raise
        broadcast_object(("ok", value))
        return value
    status, value = broadcast_object()
    if status != "ok":
        raise RankFailed(1, value)
    return value


def min_over_ranks(value: int) -> int:
    """The smallest ``value`` of all ranks (a decision every rank must take alike)."""
    return min(all_gather_objects(int(value)))


def shard(n: int) -> range:
    """This rank's contiguous share of ``n`` items (sizes differ by at most one)."""
    w, r = world_size(), rank()
    return range(r * n // w, (r + 1) * n // w)


def gather_items(local: dict[int, T], n: int) -> list[T]:
    """Per-item values computed on their owner ranks → the full list, item order, on every rank."""
    full: dict[int, T] = {}
    for part in all_gather_objects(local):
        full.update(part)
    missing = [i for i in range(n) if i not in full]
    if missing:
        raise RuntimeError(f"no rank computed items {missing[:8]}… of {n}")
    return [full[i] for i in range(n)]


def fill_rows(values: torch.Tensor, owned: list[int]) -> torch.Tensor:
    """``values`` [n, …] whose rows ``owned`` this rank computed → every row, from its owner."""
    if world_size() == 1:
        return values
    local = {i: values[i].cpu() for i in owned}
    return torch.stack(gather_items(local, values.shape[0])).to(values.device)


# -- the canonical reduction tree ---------------------------------------------------


def tree_nodes(lo: int, hi: int, depth: int) -> list[tuple[int, int]]:
    """The ``2**depth`` nodes at ``depth`` of the balanced tree over ``[lo, hi)``, left to right.

    A leaf (or empty range) above ``depth`` continues as itself on the left and
    empty ranges on the right: merging with an empty partial changes no bit."""
    if depth == 0:
        return [(lo, hi)]
    if hi - lo <= 1:
        return [(lo, hi)] + [(hi, hi)] * (2**depth - 1)
    mid = (lo + hi) // 2
    return tree_nodes(lo, mid, depth - 1) + tree_nodes(mid, hi, depth - 1)


TREE_DEPTH = 3
"""Levels of binary splits in the canonical order; below them each leaf (a contiguous run of
batches) folds left to right. Bounds the partials alive at once to TREE_DEPTH + 2 (a pending one
per level, the leaf's running fold, the newest batch's) whatever the number of batches; results
are bitwise independent of the world size for up to 2**TREE_DEPTH = 8 ranks (more ranks agree
to rounding)."""


def _internal_nodes(lo: int, hi: int, out: dict[tuple[int, int], int], levels: int,
                    leaves: list[tuple[int, int]]) -> None:
    if hi - lo <= 1 or levels <= 0:
        if hi > lo:
            leaves.append((lo, hi))
        return
    mid = (lo + hi) // 2
    out[(lo, hi)] = mid
    _internal_nodes(lo, mid, out, levels - 1, leaves)
    _internal_nodes(mid, hi, out, levels - 1, leaves)


class _Stack(Generic[T]):
    """Merges the partials of items ``lo..hi-1`` (pushed in order) in the tree order over ``[lo, hi)``,
    keeping at most one pending partial per tree level."""

    def __init__(self, lo: int, hi: int, merge: Callable[[T, T], T], levels: int = TREE_DEPTH) -> None:
        self.lo, self.hi, self.merge = lo, hi, merge
        self.splits: dict[tuple[int, int], int] = {}
        leaves: list[tuple[int, int]] = []
        _internal_nodes(lo, hi, self.splits, levels, leaves)
        self.leaf = {i: k for k, (a, b) in enumerate(leaves) for i in range(a, b)}
        self.stack: list[tuple[int, int, T]] = []
        self.next = lo

    def push(self, i: int, partial: T) -> None:
        if i != self.next:
            raise ValueError(f"items must arrive in order: expected {self.next}, got {i}")
        self.next += 1
        self.stack.append((i, i + 1, partial))
        while len(self.stack) >= 2:
            (a, m, left), (m2, c, right) = self.stack[-2], self.stack[-1]
            same_leaf = self.leaf.get(a) == self.leaf.get(c - 1)
            if m != m2 or not (same_leaf or self.splits.get((a, c)) == m):
                break
            self.stack[-2:] = [(a, c, self.merge(left, right))]

    def result(self) -> T | None:
        if self.next != self.hi:
            raise RuntimeError(f"items {self.next}..{self.hi - 1} never arrived")
        if not self.stack:
            return None
        assert len(self.stack) == 1, self.stack  # a complete tree collapses to its root
        return self.stack[0][2]


class TreeReduce(Generic[T]):
    """Reduce per-item partials over items ``0..n-1`` across ranks in the canonical tree order.

    ``items`` are this rank's items (push their partials in that order); :meth:`result`
    is a collective and returns the same merged partial (or None when ``n`` is 0) on every rank.

    ``levels``: the tree's binary splits (:data:`TREE_DEPTH`); the partials alive at once are ``levels + 2``, so
    a large partial (a layer's input moments) takes ``levels=1``: the same bits for 1 or 2 ranks (more agree to
    rounding). ``ranks=False``: this process alone, every item its own, whatever the process group (a step rank 0
    runs by itself); the order, and so the result, is the same as across ranks.

    >>> tr = TreeReduce(5, merge=lambda a, b: a + b)
    >>> for i in tr.items: tr.push(i, float(i))
    >>> tr.result()   # ((0 + 1) + (2 + (3 + 4)))
    10.0
    """

    def __init__(self, n: int, merge: Callable[[T, T], T], *, portable: Callable[[T], T] = lambda p: p,
                 levels: int = TREE_DEPTH, ranks: bool = True) -> None:
        w, r = (world_size(), rank()) if ranks else (1, 0)
        self.depth = math.ceil(math.log2(w)) if w > 1 else 0
        self.nodes = tree_nodes(0, n, self.depth)
        k = len(self.nodes)
        self.mine = list(range(r * k // w, (r + 1) * k // w))
        self.items = [i for j in self.mine for i in range(*self.nodes[j])]
        self._merge, self._portable = merge, portable
        levels = max(levels - self.depth, 0)
        self._stacks = {j: _Stack(*self.nodes[j], merge, levels) for j in self.mine}
        self._owner = {i: j for j in self.mine for i in range(*self.nodes[j])}

    def merge(self, a: T | None, b: T | None) -> T | None:
        if a is None:
            return b
        if b is None:
            return a
        return self._merge(a, b)

    def push(self, i: int, partial: T) -> None:
        self._stacks[self._owner[i]].push(i, partial)

    def result(self) -> T | None:
        local = {j: self._stacks[j].result() for j in self.mine}
        if len(self.nodes) == 1:
            return local[self.mine[0]] if self.mine else None
        local = {j: None if p is None else self._portable(p) for j, p in local.items()}
        level = gather_items(local, len(self.nodes))
        while len(level) > 1:
            level = [self.merge(level[k], level[k + 1]) for k in range(0, len(level), 2)]
        return level[0]
