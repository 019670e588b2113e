"""Per-weight statistics that price a change of any weight matrix in closed form.

For a linear map ``y = W x`` whose weight becomes ``W + ΔW``, the output error
at token ``t`` is ``e_t = ΔW x_t``. With ``G_t = ∂(Σ nll)/∂y_t`` the gradient of
the summed next-token loss, the diagonal empirical-Fisher estimate of the mean
loss change is

    Δ nll ≈ ½ Σ_o F_o · (ΔW Ĥ ΔWᵀ)_oo,   F_o = mean_t G²_{t,o},   Ĥ = mean_t x_t x_tᵀ

(second order, assuming the squared gradient and the squared error of an output
are uncorrelated over tokens). Two passes measure the pieces:

* :func:`output_fisher` — one forward + backward over the calibration windows:
  ``F`` at every ``nn.Linear``'s output, at the token embedding's output, and
  the token counts (the embedding's "input moment" is diagonal: ``Ĥ_vv`` is
  token ``v``'s frequency);
* :func:`input_moments` — forward only: ``Ĥ`` at the input of each named
  ``nn.Linear``; modules fed the same tensor (q/k/v, gate/up) share one matrix.
  Float32 sums, ``d_in²`` each (each batch's ``XᵀX`` is a float32 product anyway; a
  float64 sum would double the memory for nothing): the caller decides how many
  modules a pass holds (Qwen2.5-1.5B's down projections are 8,960² = 321 MB each).

``diag(Ĥ)`` is also what llama.cpp's ``llama-imatrix`` collects (its importance
matrix), so the same pass gives the quantizer its column weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from compressor.core.distributed import TreeReduce, all_gather_objects, world_size
from compressor.core.onload import input_device
from compressor.core.progress import progress
from compressor.engine.sensitivity import backward_rows, frozen, summed_loss_backward

#: Key of the token embedding in :func:`output_fisher`'s result.
EMBEDDING = "<embedding>"


@dataclass
class Fisher:
    """Mean squared loss gradient at each module's output, and token counts."""

    grad_sq: dict[str, torch.Tensor]
    """Module name (``EMBEDDING`` for the token embedding) → mean over tokens of G², float64 [d_out]."""
    token_counts: torch.Tensor
    """Occurrences of each token id among the inputs, float64 [vocab]."""
    tokens: int


def linear_names(model: nn.Module) -> list[str]:
    """Every ``nn.Linear`` of the model, the output head included, in module order."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def _add_dicts(a: dict, b: dict) -> dict:
    """``a + b`` key by key (in place on ``a``; a key in one only is kept as it is)."""
    for k, v in b.items():
        a[k] = a[k].add_(v) if k in a else v
    return a


class GradSquares:
    """Sums of the squared loss gradient at module outputs: backward hooks on every module in ``names``, added
    per batch (float32 within a batch, float64 across), removed on exit. The batches' sums are merged in the
    canonical tree order (:class:`~compressor.core.distributed.TreeReduce`): the same bits whether one process
    ran every batch or ranks ran shares (``parallel``) — run :attr:`items`, calling :meth:`begin` before each."""

    def __init__(self, model: nn.Module, names: list[str], n_batches: int, parallel: bool = False) -> None:
        self.model, self.names = model, names
        self.tree = TreeReduce(n_batches, _add_dicts, ranks=parallel)
        self.items = self.tree.items
        """The batches this process runs, in order (all of them in one process)."""
        self.per_batch: dict[int, dict[str, torch.Tensor]] = {}
        self.batch: int | None = None
        self._handles: list = []

    def begin(self, b: int) -> None:
        """Gradients seen from now on are batch ``b``'s (batches may interleave: set it before each)."""
        self.batch = b

    def add(self, key: str, g: torch.Tensor) -> None:
        # squares summed in float32 within a batch (a few thousand positive terms), then float64 across batches:
        # a float64 copy of every gradient took 13 % of SmolLM2's pass
        g = g.detach().reshape(-1, g.shape[-1]).float()
        g2 = g.square().sum(0).double().cpu()
        sums = self.per_batch.setdefault(self.batch, {})
        sums[key] = g2 if key not in sums else sums[key] + g2

    def __enter__(self) -> "GradSquares":
        def hook(name: str):
            def fwd(module, args, output):
                if output.requires_grad:
                    output.register_hook(lambda g: self.add(name, g))
            return fwd

        self._handles = [self.model.get_submodule(n).register_forward_hook(hook(n)) for n in self.names]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def fisher(self, n_tokens: int, counted: torch.Tensor) -> Fisher:
        """The means over ``n_tokens`` and the token counts of ``counted`` (with ``parallel``, a collective)."""
        for b in self.items:
            self.tree.push(b, self.per_batch.pop(b, {}))
        sums = self.tree.result() or {}
        vocab = self.model.get_input_embeddings().weight.shape[0]
        counts = torch.bincount(counted.flatten().cpu(), minlength=vocab).double()[:vocab]
        return Fisher({k: v / n_tokens for k, v in sums.items()}, counts, counted.numel())


def output_fisher(model: nn.Module, windows: torch.Tensor, *, batch_size: int = 8,
                  names: list[str] | None = None, counted: torch.Tensor | None = None,
                  parallel: bool = False) -> Fisher:
    """One forward + backward per batch of ``windows`` ([n, seq_len] token ids): ``F`` at the output of
    each linear in ``names`` (default: all) and of the token embedding. The token counts are of
    ``counted`` (default ``windows``): a token's frequency needs no pass, so it can come from more text
    than the gradients do. The whole model's weights are alive during each backward: an onloaded model is
    measured one layer at a time instead (:func:`compressor.engine.layerwise.output_fisher_sequential`).
    ``parallel``: under a process group, each rank runs its share of the batches (a collective)."""
    names = linear_names(model) if names is None else names
    rows = backward_rows(model, windows.shape[1], batch_size)
    starts = range(0, windows.shape[0], rows)
    with GradSquares(model, names, len(starts), parallel) as squares, frozen(model):
        for b in progress(squares.items, desc="price: loss gradients", unit="batch"):
            squares.begin(b)
            ids = windows[starts[b]:starts[b] + rows].to(input_device(model))
            squares.add(EMBEDDING, summed_loss_backward(model, ids))
    return squares.fisher(windows.numel(), windows if counted is None else counted)


#: Width from which :func:`gram` copies a bfloat16 ``xᵀ`` contiguous (``tools/size/bench_gram.py``, 4,096 tokens, an AMX
#: CPU): with the copy at every width it was 1.08 × the transposed form at 3,072 and 1.42 × at 8,960, but 0.78–0.91 ×
#: at 1,536–2,048, where the copy costs more than the plain GEMM saves; ``tools/size/results/gram_bfloat16.json`` is the
#: form as it ships.
UNTRANSPOSED_FROM = 3072


def gram(x: torch.Tensor) -> torch.Tensor:
    """``xᵀx`` (float32) of ``x`` [tokens, d], whatever autocast is on. A product rounded to bfloat16 puts errors
    of up to 4 % of Ĥ's mean diagonal on its larger entries (an attention output's moments, off-grid SmolLM2-135M)
    and Ĥ's damped Cholesky fails; so a bfloat16 ``x`` is multiplied twice, the second product accumulating onto
    minus the first inside the GEMM (:func:`_two_pass`, where it does that: float32 to about 5e-6 of the largest
    entry), and a float32 one in float32. The upper blocks of column groups about 256 wide, the lower mirrored: the
    same dot products for about 70 % of the time at d = 1,536. A wide bfloat16 ``xᵀ`` (:data:`UNTRANSPOSED_FROM`)
    is copied contiguous once, so that each product is a plain (untransposed) GEMM: oneDNN's bfloat16 ``xᵀx`` with
    a transposed operand took 1.6 × as long (8,960 wide, 2,048 tokens, AMX). The two passes add into the output in
    place. A down projection's 8,960-wide Ĥ: 0.89 → 0.61 s a batch of 4,096 tokens (``tools/size/bench_gram.py``)."""
    d = x.shape[1]
    k = min(8, max(1, d // 256))
    two = x.dtype == torch.bfloat16 and _two_pass_exact(x.device.type)
    if not two:
        x = x.float()
    with torch.autocast(x.device.type, enabled=False):
        # the copy pays from about 3,072 wide (bfloat16; float32's GEMM is as fast transposed): tools/size/bench_gram.py
        xt = x.T.contiguous() if two and d >= UNTRANSPOSED_FROM else x.T
        if k == 1:
            return _two_pass(xt, x) if two else xt @ x
        edges = [round(i * d / k) for i in range(k + 1)]
        out = torch.empty(d, d, dtype=torch.float32, device=x.device)
        for a, b in zip(edges, edges[1:]):
            blk = out[a:b, a:]
            if two:
                _two_pass(xt[a:b], x[:, a:], out=blk)
            else:
                blk.copy_(xt[a:b] @ x[:, a:])
            out[b:, a:b] = blk[:, b - a:].T
        return out


def _two_pass(at: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``at @ b`` in float32 from two bfloat16 GEMMs: ``r = at @ b`` rounded, then ``at @ b − r`` accumulated in
    the GEMM's float32 and rounded (relative 2⁻⁹ of a residual itself 2⁻⁹ of the entry); their float32 sum,
    added into ``out`` (a float32 view: no new d² matrices) where given."""
    r = at @ b
    if out is None:
        out = torch.empty(r.shape, dtype=torch.float32, device=r.device)
    return out.copy_(r).add_(torch.addmm(r, at, b, beta=-1))


def _autocast_bfloat16(device_type: str) -> bool:
    return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) == torch.bfloat16


@functools.lru_cache(maxsize=None)
def _two_pass_exact(device_type: str) -> bool:
    """Whether :func:`_two_pass` is float32-accurate on ``device_type`` (its bfloat16 GEMM adds the accumulator
    before it rounds; a kernel that rounds first returns ``r`` alone): checked once on a product whose bfloat16
    rounding is large."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(256, 64, generator=g) * torch.logspace(-2, 1, 64)).to(device_type, torch.bfloat16)
    with torch.autocast(device_type, enabled=False):
        exact = x.float().T @ x.float()
        err = float((_two_pass(x.T.contiguous(), x) - exact).abs().max() / exact.abs().max())
    return err < 1e-4


class _AllSeen(Exception):
    """Raised by :func:`input_moments`'s hooks once every named module has had its input: the rest of the
    forward pass would compute nothing it needs."""


class MomentTaps:
    """Forward pre-hooks that add each batch's ``XᵀX`` at the input of every linear in ``names``: modules that
    read the same tensor (q/k/v, gate/up) share one sum. With ``stop``, a batch's forward is cut short
    (:class:`_AllSeen`) once every module has read its input. Run the batches of :attr:`items` in order, calling
    :meth:`end_batch` after each; the hooks are removed on exit.

    The batches' sums merge in the canonical tree order with one split (``TreeReduce(levels=1)``: the first
    half's sum, then the second's, then the two added — one more partial alive than a running sum, where the
    default tree would hold five of these d_in² matrices): the same bits in one process or across two ranks
    (``parallel``: each runs its half)."""

    def __init__(self, model: nn.Module, names: list[str], n_batches: int, stop: bool = False,
                 parallel: bool = False) -> None:
        self.model, self.wanted, self.stop = model, set(names), stop
        self.tree = TreeReduce(n_batches, _merge_taps, portable=_cpu_taps, levels=1, ranks=parallel)
        self.parallel = parallel and world_size() > 1
        self.items = self.tree.items
        """The batches this process runs, in order (all of them in one process)."""
        self.rows: dict[str, int] = {}
        """Tokens each module read (a routed expert reads the tokens sent to it; every other module all)."""
        self.alias: dict[str, str] = {}
        self._sums: dict[str, torch.Tensor] = {}
        self._rows: dict[str, int] = {}
        self._seen: set[str] = set()
        # this batch's inputs by tensor identity → (the module that took it first, the tensor, held so that
        # its memory cannot be reused by a later input of the same batch)
        self._first_reader: dict[int, tuple[str, torch.Tensor]] = {}
        self._handles: list = []

    def _hook(self, name: str):
        def fwd(module, args):
            x = args[0]
            reader = self._first_reader.get(id(x))
            if reader is not None and reader[1] is x and reader[0] != name:
                self.alias[name] = reader[0]
            else:
                self._first_reader[id(x)] = (name, x)
                x = x.detach().reshape(-1, x.shape[-1])
                if _autocast_bfloat16(x.device.type):  # the input as the layer multiplies it
                    x = x.to(torch.bfloat16)
                xx = gram(x).cpu()
                self._sums[name] = xx if name not in self._sums else self._sums[name] + xx
                self._rows[name] = self._rows.get(name, 0) + x.shape[0]
            self._seen.add(name)
            if self.stop and len(self._seen) == len(self.wanted):
                raise _AllSeen
        return fwd

    def __enter__(self) -> "MomentTaps":
        self._handles = [self.model.get_submodule(n).register_forward_pre_hook(self._hook(n)) for n in self.wanted]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def end_batch(self, b: int) -> None:
        """Batch ``b`` has run: its sums join the tree."""
        self.tree.push(b, (self._sums, self._rows))
        self._sums, self._rows = {}, {}
        self._first_reader.clear()
        self._seen.clear()

    def moments(self, n_tokens: int) -> dict[str, torch.Tensor]:
        """The means over the tokens each module read (float32 [d_in, d_in], CPU): ``n_tokens``, or fewer for a
        routed expert (its Ĥ is the mean over the tokens sent to it; its F, a mean over all tokens, carries how
        often it is chosen). Shared matrices kept shared. With ``parallel``, a collective."""
        sums, rows = self.tree.result() or ({}, {})
        if self.parallel:  # which modules share a sum, as every rank saw it (a rank may have run no batch)
            merged: dict[str, str] = {}
            for alias in all_gather_objects(self.alias):
                for name, src in alias.items():
                    merged.setdefault(name, src)
            self.alias = merged
        self.rows = dict(rows)
        out = {k: v.div_(min(rows.get(k, n_tokens), n_tokens) or 1) for k, v in sums.items()}
        for name, src in self.alias.items():
            out[name] = out[src]
            self.rows[name] = self.rows[src]
        return out


def _merge_taps(a: tuple[dict, dict], b: tuple[dict, dict]) -> tuple[dict, dict]:
    for k, n in b[1].items():
        a[1][k] = a[1].get(k, 0) + n
    return _add_dicts(a[0], b[0]), a[1]


def _cpu_taps(p: tuple[dict, dict]) -> tuple[dict, dict]:
    return {k: v.cpu() for k, v in p[0].items()}, p[1]


def input_moments(model: nn.Module, windows: torch.Tensor, names: list[str], *,
                  batch_size: int = 8, tokens: dict[str, int] | None = None,
                  parallel: bool = False) -> dict[str, torch.Tensor]:
    """``Ĥ = mean_t x_t x_tᵀ`` (float32 [d_in, d_in], CPU) at the input of each linear in ``names``; modules
    that read the same tensor get the same matrix object. Each batch's forward pass stops once every named
    module has read its input (moments of the first layers cost only the first layers' compute). An onloaded
    model is measured one layer at a time instead (:func:`compressor.engine.layerwise.layer_moments`).
    ``tokens``: filled with the tokens each module read (fewer than all for a routed expert). ``parallel``:
    under a process group, each rank runs its share of the batches (a collective)."""
    device = input_device(model)
    starts = range(0, windows.shape[0], batch_size)
    with MomentTaps(model, names, len(starts), stop=True, parallel=parallel) as taps, torch.no_grad():
        for b in progress(taps.items, desc="price: input moments", unit="batch"):
            try:
                model(windows[starts[b]:starts[b] + batch_size].to(device), use_cache=False)
            except _AllSeen:
                pass
            taps.end_batch(b)
    out = taps.moments(windows.numel())
    if tokens is not None:
        tokens.update(taps.rows)
    return out
