"""Data parallelism (:mod:`compressor.core.distributed`): 2 gloo ranks give the same bits as 1 process.

The ranks are spawned by the test (CPU, gloo, one intra-op thread each, a free
local port); the 1-process reference runs in the test process on one thread
too, because a batch's forward is bitwise reproducible only at a fixed thread
count. Everything is written under ``tmp_path``.
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from checkpoints import save_tiny_checkpoint
from tiny import random_windows, tiny_model

import compressor
from compressor.core.distributed import TREE_DEPTH, TreeReduce, _Stack, tree_nodes
from compressor.engine.walker import LayerWalker
from compressor.evaluation.gate import Evaluator
from compressor.evaluation.perplexity import perplexity
from compressor.engine.sensitivity import output_grad_moments

pytestmark = pytest.mark.usefixtures("torch_single_thread")

WORLD = 2
SEQ = 16


# -- what every rank (and the reference process) computes ---------------------------------------


def _walk_state(model) -> dict[str, torch.Tensor]:
    """Every reduced statistic of a walk with a teacher target (student ≠ teacher after layer 0)."""
    fit_w, held_w = random_windows(12, SEQ, seed=0), random_windows(6, SEQ, seed=1)
    walker = LayerWalker(model, {"fit": fit_w, "heldout": held_w}, batch_size=2)
    out: dict[str, torch.Tensor] = {"local_batches": torch.tensor(walker.local)}

    def on_layer(i, st):
        out.update(st.xy.state_dict())
        out.update(st.zfit.state_dict(f"z{i}.fit"))
        out.update(st.zheld.state_dict(f"z{i}.held"))
        out[f"energy{i}"] = torch.tensor([st.resid_energy], dtype=torch.float64)
        return torch.nn.Identity() if i == 0 else None  # the student stream diverges from the teacher

    walker.walk(on_layer, hidden=True, target="teacher_residual", spike_factor=1.2)
    modules = {i: f"model.layers.{i}.mlp" for i in range(len(walker.layers))}
    for i, g in output_grad_moments(model, fit_w, modules, batch_size=3).items():
        out[f"grad{i}"] = g
    return out


def _evaluations(model) -> dict:
    tokens = random_windows(1, 700, seed=3).flatten()
    ev = Evaluator.build(model, {"a": tokens, "b": tokens[:300]}, seq_len=32, stride=16, batch_size=3, top_k=8)
    model.model.layers[1].mlp = torch.nn.Identity()
    return {"baseline": ev.baseline.to_json(), "after": ev(model).to_json(),
            "ppl": perplexity(model, tokens, seq_len=32, stride=24, batch_size=2).to_json()}


def _size_statistics(model, parallel: bool) -> dict[str, torch.Tensor]:
    """The size plan's statistics (F and Ĥ), whole-model and layer-sequential, each rank running its share."""
    from compressor.engine.layerwise import layer_moments, output_fisher_sequential
    from compressor.engine.tensorstats import input_moments, linear_names, output_fisher

    w, names = random_windows(11, SEQ, seed=4), linear_names(model)
    out = {}
    for tag, fisher in (("F", output_fisher), ("Fseq", output_fisher_sequential)):
        f = fisher(model, w, batch_size=1, parallel=parallel)
        out.update({f"{tag}.{k}": v for k, v in f.grad_sq.items()})
    tokens: dict[str, int] = {}
    out.update({f"H.{k}": v for k, v in input_moments(model, w, names, batch_size=2, tokens=tokens,
                                                          parallel=parallel).items()})
    out["H.tokens"] = torch.tensor([tokens[n] for n in names])
    for _, moments in layer_moments(model, w, batch_size=2, parallel=parallel):
        out.update({f"Hseq.{k}": v for k, v in moments.items()})
    # one batch: rank 1 runs none, yet knows which modules share a sum (k/v read q's input) as rank 0 does
    out.update({f"H1.{k}": v for k, v in input_moments(model, w[:2], names, batch_size=2, parallel=parallel).items()})
    for _, moments in layer_moments(model, w[:2], batch_size=2, parallel=parallel):
        out.update({f"H1seq.{k}": v for k, v in moments.items()})
    return out


def _pipeline_recipe(source: Path, out: Path) -> dict:
    return {
        "model": {"source": str(source)},
        "calibration": {"dataset": "mix", "max_tokens": 1024, "seq_len": 32, "self_tokens": 256},  # rank 0 samples
        "evaluation": {"max_tokens": 1024, "seq_len": 64, "stride": 32},
        "policy": {"threshold": -100, "ppl_budget": 0.5},
        "replacement": {"kind": "affine"},
        "output": {"path": str(out)},
        "measure": {"cache": False},
    }


def _run_pipeline(recipe: dict) -> dict:
    res = compressor.run(compressor.recipe_from_dict(recipe))
    return {"exit_code": res.exit_code, "blocks": res.report["blocks"], "ppl": res.report["perplexity"]}


SIZE_RUNS = {"gguf": ("Q4_0", "none"), "gguf-onloaded": ("Q4_0", "disk"),
             "compressed-tensors-onloaded": ("W4A16", "disk")}
"""A GGUF size in memory and onloaded (layer by layer), and a compressed-tensors W4A16 size onloaded (its
cross-fitted halves as two splits of the layer-by-layer pass). The compressed-tensors plan once flipped between
W8A16 and W8A16_CH on a layer where the two are one grid: their order came from a set of names, which each
process hashes differently; they are now ordered by bytes, then name."""


def _size_run(folder: Path, out: str, run: str) -> dict:
    """A size plan of a tiny Llama folder (:data:`SIZE_RUNS`): its exit code and what it planned."""
    from test_size_stream import _recipe

    size, offload = SIZE_RUNS[run]
    res = compressor.run(_recipe(folder, folder / "src", out, offload, size=size))
    plan = res.report.get("size_plan", {})
    return {"exit_code": res.exit_code, "message": res.report.get("message"), "ranks": plan.get("ranks"),
            "compensated": plan.get("compensated_tensors"),
            "types": {r.get("tensor", r.get("module")): r.get("type", r.get("scheme")) for r in plan.get("tensors", [])}}


def _rank_main(rank: int, port: int, folder: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TQDM_DISABLE="1")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        folder = Path(folder)
        result = {"walk": _walk_state(tiny_model("llama")), "eval": _evaluations(tiny_model("llama")),
                  "statistics": _size_statistics(tiny_model("llama"), parallel=True),
                  # a step rank 0 runs alone under the process group: no collective, the same bits
                  "alone": _size_statistics(tiny_model("llama"), parallel=False) if rank == 0 else None,
                  "run": _run_pipeline(_pipeline_recipe(folder / "in", folder / "out-ranks")),
                  "size": {run: _size_run(folder / "size", f"ranks-{run}", run) for run in SIZE_RUNS}}
        torch.save(result, folder / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One spawn of WORLD ranks (starting processes is most of the cost) running every job."""
    folder = tmp_path_factory.mktemp("ranks")
    save_tiny_checkpoint(folder / "in", "llama")
    pytest.importorskip("llama_cpp")
    from test_size_stream import _folder

    (folder / "size").mkdir()
    _folder(folder / "size")
    env = {"COMPRESSOR_CACHE_DIR": str(folder / "cache")}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # inherited by the ranks and by the 1-process reference runs
    try:
        mp.spawn(_rank_main, args=(_free_port(), str(folder)), nprocs=WORLD, join=True)
        results = [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
        for r in range(WORLD):
            (folder / f"rank{r}.pt").unlink()
        yield folder, results
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -- the tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 5, 9, 16, 40])
@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_tree_order_does_not_depend_on_world_size(n, world):
    """The subtree partials of up to 8 ranks merge into the 1-process tree, symbol for symbol."""
    merge = lambda a, b: f"({a}+{b})"  # noqa: E731
    single = _Stack(0, n, merge)
    for i in range(n):
        single.push(i, str(i))
    depth = (world - 1).bit_length()
    nodes = tree_nodes(0, n, depth)
    assert len(nodes) == 2**depth and sum(hi - lo for lo, hi in nodes) == n
    parts = []
    for lo, hi in nodes:
        s = _Stack(lo, hi, merge, TREE_DEPTH - depth)
        for i in range(lo, hi):
            s.push(i, str(i))
        parts.append(s.result())
    tr = TreeReduce(n, merge)  # no process group: one rank with every item
    assert tr.items == list(range(n))
    while len(parts) > 1:
        parts = [tr.merge(parts[k], parts[k + 1]) for k in range(0, len(parts), 2)]
    assert parts[0] == single.result()


def test_tree_keeps_few_partials_alive_and_folds_leaves_in_order():
    """Below TREE_DEPTH levels of splits a leaf folds left to right: at most TREE_DEPTH + 2 partials
    are alive, whatever the number of batches."""
    merge = lambda a, b: f"({a}+{b})"  # noqa: E731
    n = 64
    s = _Stack(0, n, merge)
    peak = 0
    for i in range(n):
        s.push(i, str(i))
        peak = max(peak, len(s.stack) + 1)  # + the newest partial before it is pushed
    assert peak <= TREE_DEPTH + 2
    out = s.result()
    assert "(((((((0+1)+2)+3)+4)+5)+6)+7)" in out  # leaf [0, 8) folds in order
    assert out.startswith("(((") and "((((((((0+1)+2)+3)+4)+5)+6)+7)+(((((((8+9)" in out  # leaves pair up


def _assert_same(a, b, where: str = "") -> None:
    """Equal bit for bit (tensors), or exactly equal (everything else)."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        bits = lambda t: t.contiguous().reshape(-1).view(torch.uint8) if t.is_floating_point() else t  # noqa: E731
        assert torch.equal(bits(a), bits(b)), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, sorted(set(a) ^ set(b)))
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{k}]")
    else:
        assert a == b or (a != a and b != b), (where, a, b)


def test_two_ranks_equal_one_process_statistics_and_evaluation(ranks):
    _, results = ranks
    walk = _walk_state(tiny_model("llama"))
    evals = _evaluations(tiny_model("llama"))
    # the batches were really split: each rank held only its share
    local = [r["walk"].pop("local_batches").tolist() for r in results]
    assert sorted(local[0] + local[1]) == walk.pop("local_batches").tolist() and local[0] and local[1]
    assert not set(local[0]) & set(local[1])
    for r in results:
        _assert_same(r["walk"], walk, "walk")
        _assert_same(r["eval"], evals, "eval")
    assert any(k.endswith("heldout.spike.n") and int(v[0]) > 0 for k, v in walk.items())


def test_two_ranks_equal_one_process_size_statistics(ranks):
    """F and Ĥ of a size plan (whole-model and layer by layer) from two ranks' halves of the batches: the same bits
    as one process running them all, and as rank 0 running them all alone under the process group."""
    _, results = ranks
    one = _size_statistics(tiny_model("llama"), parallel=False)
    assert any(k.startswith("Hseq.") for k in one) and any(k.startswith("Fseq.") for k in one)
    for r in results:
        _assert_same(r["statistics"], one, "statistics")
    _assert_same(results[0]["alone"], one, "alone")


def test_two_ranks_write_the_same_checkpoint_as_one_process(ranks):
    folder, results = ranks
    one = _run_pipeline(_pipeline_recipe(folder / "in", folder / "out-one"))
    assert one["exit_code"] == 0 and any(b["decision"] == "kept" for b in one["blocks"])
    for r in results:
        _assert_same(r["run"], one, "run")  # exit code, every decision and its perplexities, the perplexity report
    digest = {name: hashlib.sha256((folder / name / "model.safetensors").read_bytes()).hexdigest()
              for name in ("out-one", "out-ranks")}
    assert digest["out-one"] == digest["out-ranks"]
    # rank 0 alone wrote: one output folder, no stray temporary folder, no cache, no leftovers
    assert sorted(p.name for p in folder.iterdir() if p.name not in ("size", "one.pt")) == ["in", "out-one", "out-ranks"]


def _one_process(rank: int, folder: str) -> None:
    torch.set_num_threads(1)
    os.environ["TQDM_DISABLE"] = "1"
    size = Path(folder) / "size"
    torch.save({run: _size_run(size, f"one-{run}", run) for run in SIZE_RUNS}, Path(folder) / "one.pt")


@pytest.fixture(scope="module")
def one_process(ranks) -> dict:
    """The size runs in one fresh process (no process group), as the ranks started: nothing an earlier test
    left in this process (a setting, a cache) can tell them apart."""
    folder, _ = ranks
    mp.spawn(_one_process, args=(str(folder),), nprocs=1, join=True)
    return torch.load(folder / "one.pt", weights_only=False)


@pytest.mark.parametrize("run", sorted(SIZE_RUNS))
def test_two_ranks_plan_the_same_size_file_as_one_process(ranks, one_process, run):
    """A size run under two gloo ranks (each measuring half the statistics' batches: in memory, onloaded layer by
    layer, cross-fitted halves; then each pricing its share of the tensors and rounding its share of the plan)
    writes the files one process writes, byte for byte; rank 0 alone wrote them."""
    folder, results = ranks
    size = folder / "size"
    one = dict(one_process[run])
    assert one["exit_code"] == 0 and one["types"], one["message"]
    assert one.pop("ranks") is None  # one process says nothing of ranks
    for r in results:
        got = dict(r["size"][run])
        shared = got.pop("ranks")
        _assert_same(got, one, run)
        # the work was shared: every rank priced tensors and rounded some of the plan's, and none twice
        assert shared["world_size"] == WORLD and all(n > 0 for n in shared["tensors_priced"]), shared
        assert sum(shared["tensors_priced"]) == len(one["types"]), shared
        assert one["compensated"] and all(n > 0 for n in shared["tensors_rounded"]), shared
    files = sorted(p.relative_to(size / f"one-{run}") for p in (size / f"one-{run}").rglob("*")
                   if p.suffix in (".gguf", ".safetensors"))
    assert files
    for f in files:
        assert (size / f"one-{run}" / f).read_bytes() == (size / f"ranks-{run}" / f).read_bytes(), f
    assert not list(size.glob(".*.size-*")) and not list(size.glob(".*staging*"))


def test_shares_deal_each_moment_to_one_rank_by_work():
    """Pricing and rounding are split by input moment: the layers that read one Ĥ (q/k/v, gate/up) go to one rank
    (one GPTQ factor, one fused unit); the costliest moment first, onto the least loaded rank, the load carried
    across groups; a stack of experts stays on rank 0; one process owns everything; every rank deals alike."""
    from compressor.engine.layerwise import layer_moments
    from compressor.pipeline.size.share import Shares, _cost

    model = tiny_model("llama")
    groups = list(layer_moments(model, random_windows(4, SEQ, seed=0), batch_size=2))
    deals = []
    for _ in range(2):  # two ranks deal from the same shapes: the same shares
        shares = Shares(world=2)
        for group, moments in groups:
            shares.deal(model, group, moments)
        deals.append(shares.owner)
    assert deals[0] == deals[1]
    owner = deals[0]
    for i in range(len(model.model.layers)):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        assert owner[f"{attn}.q_proj"] == owner[f"{attn}.k_proj"] == owner[f"{attn}.v_proj"]
        assert owner[f"{mlp}.gate_proj"] == owner[f"{mlp}.up_proj"]
    assert set(owner.values()) == {0, 1}
    # longest processing time first, onto the least loaded rank: the loads end within the largest unit's work
    # (dealing everything to one rank would leave a gap of the whole model's)
    largest = max(_cost(model, [m for m in group if id(moments[m]) == id(moments[n])])
                  for group, moments in groups for n in group)
    assert abs(shares.load[0] - shares.load[1]) <= largest < sum(shares.load) / 2
    one = Shares(world=1)
    for group, moments in groups:
        one.deal(model, group, moments)
    assert set(one.owner.values()) == {0} and one.mine(groups[0][0], rank=0) == groups[0][0]
    stays = Shares(world=2)
    layer0, moments0 = groups[0]
    stays.deal(model, layer0, moments0, stays=set(layer0))
    assert set(stays.owner.values()) == {0}


def _exchange_main(rank: int, port: int, folder: str) -> None:
    """Every shape of :func:`~compressor.pipeline.size.share.exchange`, under two gloo ranks: results in rank
    order (on every rank, or on rank 0 only), and a failure on rank 1 raised on rank 0, which then says so to
    rank 1 as the runner does on leaving a run."""
    import torch.distributed as tdist

    from compressor.core import distributed as cdist
    from compressor.pipeline.size.share import exchange

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=WORLD)
    out: dict = {}
    try:
        # tensors travel apart from the pickle, as raw bytes: every dtype, shape and layout back to the bit, the same
        # object met twice back as one object; a Parameter or a tensor that needs its gradient pickled as it was
        gen = torch.Generator().manual_seed(rank)
        h = torch.randn(6, 6, generator=gen)
        obj = {"q": h, "k": h, "ids": torch.arange(5) + rank, "scalar": torch.tensor(3.5, dtype=torch.float64),
               "empty": torch.ones(0, 3), "mask": torch.tensor([True, False]),
               "bf16": torch.randn(3, 3, generator=gen).bfloat16(), "transposed": torch.randn(4, 2, generator=gen).t(),
               "param": torch.nn.Parameter(torch.ones(2)), "grad": torch.ones(2, requires_grad=True),
               "text": f"rank {rank}", "rows": {"q": 7 + rank}}
        got = cdist.all_gather_objects(obj)
        ref = [None] * WORLD
        tdist.all_gather_object(ref, obj)
        out["objects"] = got, ref, [g["q"] is g["k"] for g in got], [type(g["param"]).__name__ for g in got]
        out["all"] = exchange(lambda: {"rank": rank})
        out["main"] = exchange(lambda: [rank] * (rank + 1), to_main=True)

        def fails():
            if rank == 1:
                raise ValueError("no such tensor")
            return rank

        for mode in ("all", "main"):
            try:
                out[f"{mode}-failed"] = exchange(fails, to_main=mode == "main")
                if rank == 1 and mode == "main":  # rank 1 hears it where it waits next (the rounding's loop)
                    out["main-failed"] = ("verdict", cdist.broadcast_object())
            except cdist.RankFailed as exc:
                out[f"{mode}-failed"] = ("RankFailed", exc.exit_code, str(exc))
            except RuntimeError as exc:
                out[f"{mode}-failed"] = ("RuntimeError", str(exc))
                cdist.broadcast_object(((4, str(exc)), None))  # the runner's last word after a failure
        torch.save(out, Path(folder) / f"exchange{rank}.pt")
    finally:
        tdist.destroy_process_group()


def test_exchange_gathers_in_rank_order_and_carries_a_failure(tmp_path):
    """``all_gather_objects`` sends tensors as raw bytes beside the pickle, the same objects as torch's own
    gather; ``exchange`` gathers in rank order and carries a failure to rank 0."""
    mp.spawn(_exchange_main, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    r0, r1 = (torch.load(tmp_path / f"exchange{r}.pt", weights_only=False) for r in range(WORLD))
    for r in (r0, r1):
        got, ref, aliased, kinds = r["objects"]
        _assert_same(got, ref, "objects")
        assert all(aliased) and kinds == ["Parameter"] * WORLD and got[1]["ids"].tolist() == [1, 2, 3, 4, 5]
        assert got[0]["transposed"].shape == (2, 4) and got[1]["grad"].requires_grad
    assert r0["all"] == r1["all"] == [{"rank": 0}, {"rank": 1}]
    assert r0["main"] == [[0], [1, 1]] and r1["main"] is None
    for mode in ("all", "main"):
        kind, message = r0[f"{mode}-failed"]
        assert kind == "RuntimeError" and "rank 1 failed" in message and "ValueError: no such tensor" in message
    # rank 1 leaves the all-gather with rank 0's verdict (its exit code), and hears it where it waits next after
    # handing its failure to rank 0
    assert r1["all-failed"][:2] == ("RankFailed", 4) and "rank 1 failed" in r1["all-failed"][2]
    verdict = r1["main-failed"]
    assert verdict[0] == "verdict" and verdict[1][0][0] == 4 and "rank 1 failed" in verdict[1][0][1]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


# -- exit codes under a launcher (issue 71) ------------------------------------------------------


@pytest.mark.parametrize("case", ["bad-input", "gate"])
def test_two_ranks_exit_with_the_runs_code_and_say_it_once(tmp_path, case):
    """``compressor launch --nproc-per-node 2 run …`` (torchrun's launch, gloo) exits with the run's own code —
    2 for a size that is not one, 3 for a file over the gate — where torchrun exits 1; the error is printed
    once (rank 0's), with no traceback."""
    import subprocess

    pytest.importorskip("llama_cpp")
    from test_size_stream import _folder, _recipe

    src = _folder(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(_recipe(tmp_path, src, "out", "none").to_yaml())
    extra = (["--set", "output.size=Q9_K"] if case == "bad-input" else
             ["--set", "policy.ppl_budget=0.00001", "--set", "output.size=Q2_K", "--set", "output.formats=[gguf]"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "COMPRESSOR_CACHE_DIR": str(tmp_path / "c")}
    done = subprocess.run([sys.executable, "-m", "compressor", "launch", "--nproc-per-node", str(WORLD), "run",
                           str(recipe), "-q", *extra], capture_output=True, text=True, env=env, timeout=900)
    said = done.stderr + done.stdout
    assert done.returncode == (2 if case == "bad-input" else 3), said[-3000:]
    assert "Traceback" not in said and "ChildFailedError" not in said, said[-3000:]
    first = "'Q9_K' is not a size" if case == "bad-input" else "status: rejected"  # the gate's verdict on stdout
    assert said.count(first) == 1, said[-3000:]
    assert not (tmp_path / "out").exists()
