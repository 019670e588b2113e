"""Cross-fitted Ĥ of an onloaded model (``model.offload: disk``): the even and the odd windows' input moments
measured one decoder layer at a time (:func:`~compressor.engine.layerwise.layer_moments` with ``folds``) are the
in-memory :func:`~compressor.pipeline.size.prices.fold_moments`' to the bit, and so are a size plan's passes."""

from __future__ import annotations

import pytest
import torch

from checkpoints import save_tiny_checkpoint
from tiny import random_windows

from compressor.core.onload import is_offloaded
from compressor.engine.layerwise import layer_moments
from compressor.engine.tensorstats import input_moments, linear_names
from compressor.inputs.load import load_model
from compressor.pipeline.size.prices import MomentPasses, StatisticsPrecision, fold_moments, mean_moments

pytestmark = [pytest.mark.usefixtures("torch_single_thread")]

# 9 windows: folds of 5 and 4, neither a multiple of the batch size 3 (batches of 3 + 2 and 3 + 1)
WINDOWS, BATCH = random_windows(9, 16, seed=5), 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The same tiny llama held in memory and onloaded from its safetensors."""
    src = save_tiny_checkpoint(tmp_path_factory.mktemp("layer-folds") / "src", "llama")
    whole, _, _ = load_model(str(src))
    onloaded, _, _ = load_model(str(src), offload="disk")
    assert is_offloaded(onloaded) and not is_offloaded(whole)
    return whole, onloaded


def _same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, h in want.items():
        assert torch.equal(got[name], h), name
    # modules that read the same tensor (q/k/v, gate/up) share one matrix in both
    assert {frozenset(n for n in want if want[n] is h) for h in want.values()} == \
        {frozenset(n for n in got if got[n] is h) for h in got.values()}


def test_onloaded_fold_moments_are_the_in_memory_ones(models):
    whole, onloaded = models
    names = linear_names(whole)
    assert "lm_head" in names
    even, odd = fold_moments(whole, WINDOWS, names, BATCH)
    got_even, got_odd, seen = {}, {}, []
    for linears, (e, o) in layer_moments(onloaded, WINDOWS, batch_size=BATCH, names=names, folds=True):
        assert e.keys() == o.keys() == set(linears)
        got_even.update(e)
        got_odd.update(o)
        seen.append(linears)
    assert seen[-1] == ["lm_head"]  # the head after the layers
    _same(got_even, even)
    _same(got_odd, odd)
    # without folds: one split of all the windows, input_moments' bits
    whole_h, got = input_moments(whole, WINDOWS, names, batch_size=BATCH), {}
    for _, h in layer_moments(onloaded, WINDOWS, batch_size=BATCH, names=names):
        got.update(h)
    _same(got, whole_h)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_cross_fitted_passes_of_an_onloaded_model_are_the_in_memory_ones(models, precision):
    """Also under the bfloat16 autocast a size plan's statistics may run in (its weight casts cached in memory,
    not onloaded)."""
    whole, onloaded = models
    assert MomentPasses.plan(onloaded, crossfit=True) is None
    precision = StatisticsPrecision(precision)

    def measured(model):
        passes = MomentPasses(model, WINDOWS, BATCH, precision, crossfit=True)
        folds, moments = ({}, {}), {}
        for group, (even, odd), h in passes:
            assert set(even) == set(odd) == set(h) == set(group)
            folds[0].update(even)
            folds[1].update(odd)
            moments.update(h)
        return passes, folds, moments

    held, (even, odd), moments = measured(whole)
    layered, (got_even, got_odd), got = measured(onloaded)
    assert layered.layered and not held.layered
    assert layered.count == len(onloaded.model.layers) + 1
    _same(got_even, even)
    _same(got_odd, odd)
    _same(got, moments)
    _same(got, mean_moments(even, odd, WINDOWS.shape[0]))
