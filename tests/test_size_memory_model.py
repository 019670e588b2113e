"""The size plan's memory and time models (:mod:`compressor.engine.memory`), against hand counts.

The benchmarks (``tools/memory/bench_size_memory.py``) hold the models against measured runs; these tests hold the
formulas to what their docstrings say, on shapes small enough to count by hand.
"""

from __future__ import annotations

import pytest

from compressor.engine.memory import PROCESS_BYTES, size_components, size_peak, size_work

TINY = dict(d=8, ff=16, layers=2, vocab=32, heads=2, kv_heads=1)


def test_the_peak_is_the_largest_phase_over_what_every_phase_holds():
    c = size_components(tokens=64, offload="none", **TINY)
    phases = (c["fisher"], c["hidden_states"] + c["moments"], c["converter"])
    assert c["peak"] == PROCESS_BYTES + c["resident"] + c["model"] + max(phases)
    assert c["resident"] == 2 * 32 * 8 * 4 and c["vocab_pass"] == 0  # untied embedding and head, float32
    tied = size_components(tokens=64, offload="disk", tied=True, **TINY)
    assert tied["resident"] == 32 * 8 * 4 and tied["vocab_pass"] == 0  # one tensor, on the compute device
    c = size_components(tokens=64, offload="disk", **TINY)
    # one layer's moments (q/k/v and gate/up share theirs) and two float64 factors' working sets
    assert c["moments"] == (3 * 8 * 8 + 16 * 16) * 4 + 16 * (16 * 16 + 8 * 8)


def test_an_untied_embedding_and_head_onloaded_from_disk_are_held_only_while_they_run():
    held = size_components(tokens=64, offload="cpu", **TINY)
    c = size_components(tokens=64, offload="disk", **TINY)
    head = 32 * 8 * 4
    assert c["resident"] == 0 and held["resident"] == 2 * head
    assert c["fisher"] == held["fisher"] + head  # the head's weight beside F's logits
    assert c["vocab_pass"] == 2 * head  # the head read, and its float32 copy priced and rounded
    assert c["peak"] == PROCESS_BYTES + c["model"] + max(
        c["fisher"], c["hidden_states"] + c["moments"], c["converter"], c["vocab_pass"])
    # an 8B (Llama-3.1-8B's shape, 128k vocabulary): its float32 embedding and head are 4.2 GB between passes
    eight = dict(d=4096, ff=14336, layers=32, vocab=128256, heads=32, kv_heads=8)
    gone = size_components(tokens=4096, offload="cpu", **eight)["peak"] - size_peak(tokens=4096, offload="disk",
                                                                                   **eight)
    assert gone == 2 * 128256 * 4096 * 4


def test_a_compressed_tensors_plan_makes_no_f16_and_reloads_every_weight_in_the_saved_dtype():
    c = size_components(tokens=64, offload="disk", reload_check=True, **TINY)
    linear = 2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16  # q, o; k, v of one KV head of width 4; gate, up, down
    every = 2 * (linear + 2 * 8) + 2 * 32 * 8  # both layers (norms too), the untied embedding and head
    assert c["converter"] == 0 and c["reload"] == every * 2  # bfloat16 after the library decompresses
    held = size_components(tokens=64, offload="none", reload_check=True, **TINY)
    assert held["reload"] == every * 4  # the in-memory check reloads in the compute dtype
    assert c["peak"] == PROCESS_BYTES + c["resident"] + c["model"] + max(
        c["fisher"], c["hidden_states"] + c["moments"], c["reload"])


@pytest.mark.parametrize("shape", [
    dict(d=3072, ff=8192, layers=28, vocab=128256, heads=24, kv_heads=8),   # Llama-3.2-3B
    dict(d=8192, ff=28672, layers=80, vocab=128256, heads=64, kv_heads=8),  # Llama-3.3-70B
])
def test_onloading_holds_one_layer_where_memory_holds_every_one(shape):
    held = size_components(tokens=16384, offload="none", **shape)
    streamed = size_components(tokens=16384, offload="disk", **shape)
    layer_bytes = held["model"] // (shape["layers"] + 1)
    assert streamed["model"] == 2 * layer_bytes  # the running layer and its priced copy
    assert streamed["peak"] < held["peak"] / 2
    assert size_peak(tokens=16384, offload="disk", **shape) == streamed["peak"]


def test_the_work_of_each_part_counted_by_hand():
    w = size_work(tokens=10, fisher_tokens=4, **TINY)
    kv = 1 * (8 // 2)  # one KV head of width 4
    linear = 2 * 8 * 8 + 2 * 8 * kv + 3 * 8 * 16
    grams = 3 * 8 * 8 + 16 * 16
    assert w["statistics"] == 2 * (2 * linear + 2 * grams) * 10 + (8 * 2 * linear + 6 * 32 * 8) * 4
    factors = 2 * (3 * 8 ** 3 + 16 ** 3)
    assert w["pricing"] == factors
    # GPTQ over every row: q and o (8 rows of 8), k and v (4 rows of 8), gate and up (16 of 8), down (8 of 16),
    # and the output head (32 rows of 8)
    rows_n2 = 8 * 64 + 8 * 64 + 2 * 4 * 64 + 2 * 16 * 64 + 8 * 256
    assert w["rounding"] == factors + 2 * 2 * rows_n2 + 2 * 32 * 64


def test_the_work_grows_with_the_shape_as_its_terms_say():
    small = size_work(d=2048, ff=8192, layers=16, vocab=49152, tokens=8192, heads=32, kv_heads=8)
    deeper = size_work(d=2048, ff=8192, layers=32, vocab=49152, tokens=8192, heads=32, kv_heads=8)
    assert deeper["pricing"] == 2 * small["pricing"]  # every layer's factors, nothing else
    wider = size_work(d=2048, ff=16384, layers=16, vocab=49152, tokens=8192, heads=32, kv_heads=8)
    assert wider["pricing"] > 7 * small["pricing"]  # the down projection's ff³ dominates
    more = size_work(d=2048, ff=8192, layers=16, vocab=49152, tokens=16384, heads=32, kv_heads=8)
    assert 1.5 < more["statistics"] / small["statistics"] < 2  # Ĥ's pass grows with the tokens, F's does not
