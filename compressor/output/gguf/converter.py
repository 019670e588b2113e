"""llama.cpp's own Hugging Face → GGUF converter: the names, layouts and metadata of a size plan's file.

A size plan of a Hugging Face folder re-quantizes the F16 that llama.cpp's ``convert_hf_to_gguf.py`` makes of
it — the file a deployer would quantize with ``llama-quantize`` — so every architecture the converter handles
is planned in exactly llama.cpp's layout: tensor names, q/k row permutations, stacked experts, fused
projections, RoPE factors, tokenizer and chat template. No mapping per model type is written here.

Which Hugging Face tensor and row each planned GGUF row comes from is learned by probing the converter's own
``modify_tensors`` (:mod:`.convert_driver`): :class:`ConverterLayout`. The converter is the copy in the
llama-cpp-python 0.3.36 source that the setup builds (``tools/setup.sh`` keeps it in
``.venv/share/llama.cpp-convert``; ``COMPRESSOR_LLAMA_CPP_CONVERTER`` points elsewhere), run in a subprocess
with the gguf-py it was written with.
"""

from __future__ import annotations

import ast
import errno
import functools
import json
import logging
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

#: Environment variable naming a llama.cpp source folder (with ``convert_hf_to_gguf.py``, ``conversion/``
#: and ``gguf-py/``) to use instead of the one the setup keeps.
CONVERTER_ENV = "COMPRESSOR_LLAMA_CPP_CONVERTER"
_DRIVER = Path(__file__).with_name("convert_driver.py")
#: The llama-cpp-python release whose llama.cpp source the converter is taken from (the one the setup builds).
LLAMA_CPP_VERSION = "0.3.36"


def converter_dir() -> Path:
    """Where llama.cpp's converter is: ``$COMPRESSOR_LLAMA_CPP_CONVERTER``, else the venv's copy."""
    given = os.environ.get(CONVERTER_ENV)
    return Path(given) if given else Path(sys.prefix) / "share" / "llama.cpp-convert"


def missing() -> str | None:
    """Why the converter cannot be run (None when it can), with the fix."""
    where = converter_dir()
    if (where / "convert_hf_to_gguf.py").is_file() and (where / "conversion").is_dir():
        return None
    return (f"a GGUF size plan of a Hugging Face folder uses llama.cpp's convert_hf_to_gguf.py, which is not in "
            f"{where}: run `python -m compressor.output.gguf.converter` (it fetches it from the llama-cpp-python "
            f"{LLAMA_CPP_VERSION} source; tools/setup.sh does), or set {CONVERTER_ENV} to a llama.cpp source folder "
            "of the same version")


@functools.lru_cache(maxsize=4)
def _text_model_map(where: Path) -> dict[str, str]:
    """The converter's table of Hugging Face architectures it converts (``TEXT_MODEL_MAP`` in
    ``conversion/__init__.py``), read without importing it (that imports torch and every model class)."""
    tree = ast.parse((where / "conversion" / "__init__.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "TEXT_MODEL_MAP" for t in targets if t is not None):
            return ast.literal_eval(node.value)
    return {}


def hf_architecture(config) -> str | None:
    """The architecture the converter would read off a config (its ``text_config``'s, where it names one)."""
    for cfg in (getattr(config, "text_config", None), config):
        arches = getattr(cfg, "architectures", None) if cfg is not None else None
        if arches:
            return str(arches[0])
    return None


def refusal(config) -> str | None:
    """Why the converter cannot convert a model of ``config`` (None when it can)."""
    if (why := missing()) is not None:
        return why
    arch = hf_architecture(config)
    if arch is None:
        return ("its config.json names no `architectures`, which llama.cpp's converter chooses the model class by; "
                "add the architecture (e.g. \"LlamaForCausalLM\") to config.json")
    if arch not in _text_model_map(converter_dir()):
        return (f"llama.cpp's converter (llama-cpp-python 0.3.36) does not convert {arch}, so llama.cpp does not run "
                "it; plan compressed-tensors instead (output.formats: [compressed-tensors], output.size: W4A16)")
    return None


@dataclass
class Part:
    """Consecutive rows of a GGUF tensor taken from one Hugging Face tensor: ``rows`` (its row numbers, in the
    GGUF's order; None: all of them, in order)."""

    hf: str
    count: int
    rows: np.ndarray | None = None


@dataclass
class ConverterLayout:
    """Where each planned GGUF tensor's rows come from, as the converter writes them."""

    architecture: str
    hf_architecture: str
    tensors: dict[str, list[Part] | None] = field(default_factory=dict)
    """GGUF name → its parts (None: the converter changes the values or moves columns: kept as written)."""
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """GGUF name → its shape (rows first, as torch holds it)."""

    @classmethod
    def read(cls, folder: Path) -> "ConverterLayout":
        data = json.loads((folder / "layout.json").read_text())
        tensors, shapes = {}, {}
        for name, t in data["tensors"].items():
            parts = t["parts"]
            shapes[name] = tuple(t["shape"])
            tensors[name] = None if parts == "changed" else [
                Part(p["hf"], p["count"], None if p["rows"] is None else np.load(folder / p["rows"])) for p in parts]
        return cls(data["architecture"], data["hf_architecture"], tensors, shapes)

    def _matrix(self, name: str) -> bool:
        """Two or more dimensions above 1: what a plan may quantize (a vector stays F32)."""
        return len([d for d in self.shapes[name] if d > 1]) >= 2

    @functools.cached_property
    def _by_hf(self) -> dict[str, str]:
        """Hugging Face weight → the GGUF tensor it is, or is one stacked part of (its rows in order)."""
        seen: dict[str, list[str]] = {}
        for name, parts in self.tensors.items():
            if parts is None or not self._matrix(name):
                continue  # changed by the converter, or a vector (kept in F32)
            if len(parts) > 1 and any(p.rows is not None for p in parts):
                continue  # rows of several weights interleaved: not a stack
            for p in parts:
                seen.setdefault(p.hf, []).append(name)
        return {hf: names[0] for hf, names in seen.items() if len(names) == 1}

    def gguf_name(self, hf: str) -> str | None:
        """The GGUF tensor that is the Hugging Face tensor ``hf`` (rows perhaps reordered), or that stacks it
        with others (a layer's experts: :meth:`parts`); None when none is: a tied head the converter does not
        write, a weight the converter changes or splits, a vector."""
        return self._by_hf.get(hf)

    def parts(self, name: str) -> list[str]:
        """The Hugging Face weights GGUF tensor ``name`` stacks, in its order (one for most tensors)."""
        return [p.hf for p in self.tensors.get(name) or []]

    def unplanned(self) -> list[str]:
        """GGUF matrices no Hugging Face weight maps to: written as the converter wrote them."""
        mapped = set(self._by_hf.values())
        return sorted(n for n in self.tensors if n not in mapped and self._matrix(n))

    def to_file_rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows of the Hugging Face weight (values, or a quantized type's raw row bytes: rows are quantized
        independently) in the order the GGUF tensor ``name`` stores them."""
        order = self.tensors[name][0].rows
        return rows if order is None else rows[order]


def model_name(model) -> str:
    """The id a model object's file is named after (``general.name``, by the converter's own heuristic): its
    ``_name_or_path`` — a Hub id as it is, a folder by its name — else its model type. The converter would
    otherwise name it after the work folder it was saved into."""
    config = getattr(model, "config", None)
    given = str(getattr(config, "_name_or_path", "") or getattr(model, "name_or_path", "") or "").rstrip("/")
    if given and (given.count("/") > 1 or given.startswith((".", "/", "~")) or Path(given).expanduser().exists()):
        given = Path(given).name
    return given or str(getattr(config, "model_type", "") or "model")


def convert(model_dir: Path, out: Path, workdir: Path, *, pre_tokenizer: str | None = None,
            outtype: str = "f16", named_after=None) -> ConverterLayout:
    """Run the converter on ``model_dir`` into ``out`` (``outtype``: f16, bf16 or f32), check that llama.cpp loads
    what it wrote, and probe its layout (kept in ``workdir/layout``). ``named_after``: the model ``model_dir``
    holds; where ``model_dir`` is its save in ``workdir`` the file is named after it (:func:`model_name`), not
    after that folder (a user's folder names the file, as the converter does). Raises
    :class:`~compressor.core.errors.InputError` (exit 2) with the fix where the folder is what stops the converter
    or llama.cpp, else :class:`~compressor.output.gated.NotRepresentableError` with the converter's last words."""
    from compressor.output.gated import NotRepresentableError

    if (why := missing()) is not None:
        raise NotRepresentableError(why)
    layout_dir = workdir / "layout"
    layout_dir.mkdir(parents=True, exist_ok=True)
    saved = Path(model_dir).resolve().parent == Path(workdir).resolve()  # a model object saved for the converter
    cmd = [sys.executable, str(_DRIVER), str(converter_dir()), str(model_dir), str(out), str(layout_dir), outtype,
           *([pre_tokenizer] if pre_tokenizer else []),
           *([f"--model-name={model_name(named_after)}"] if named_after is not None and saved else [])]
    env = {**os.environ, "NO_LOCAL_GGUF": "1", "TQDM_DISABLE": "1"}
    logger.info("gguf: llama.cpp's convert_hf_to_gguf.py → %s (%s)", out.name, outtype)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        if "No space left on device" in proc.stderr:  # the size stage says which file, and what is free
            raise OSError(errno.ENOSPC, f"No space left on device (llama.cpp's converter writing {out})", str(out))
        logger.debug("llama.cpp's convert_hf_to_gguf.py:\n%s", proc.stderr)
        raise converter_refusal(model_dir, proc.returncode, proc.stderr, saved=saved)
    if (said := _load_failure(out)) is not None:
        raise load_refusal(model_dir, out, said)
    return ConverterLayout.read(layout_dir)


def _load_failure(path: Path) -> str | None:
    from compressor.output.gguf.check import load_failure

    return load_failure(path)


def _last_words(stderr: str) -> str:
    """The converter's own error: the exception line a traceback ends with (its file lines say nothing to a
    user), else its last line."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b:?", line)]
    return (errors or lines or ["no message"])[-1]


#: Architectures whose converter class reads a byte-level BPE tokenizer (tokenizer.json) only when
#: tokenizer_config.json names this class, and a SentencePiece tokenizer.model otherwise (Phi-3's
#: ``set_vocab``: "Phi-4 model uses GPT2Tokenizer"); transformers 5 saves "TokenizersBackend" there.
BPE_TOKENIZER_CLASS = {"Phi3ForCausalLM": "GPT2Tokenizer"}


def converter_refusal(model_dir: Path, code: int, stderr: str, *, saved: bool = False) -> Exception:
    """The converter's failure as a user reads it: what it said, and the fix where the folder is the cause
    (``saved``: a model object's save in the work folder, whose files the user does not edit)."""
    from compressor.core.errors import InputError
    from compressor.output.gated import NotRepresentableError

    said = _last_words(stderr)
    if "tokenizer.model" in said and (model_dir / "tokenizer.json").is_file():
        arch = _folder_architecture(model_dir)
        config = _json(model_dir / "tokenizer_config.json")
        where = ("in its tokenizer_config.json (hand oneshot a tokenizer of that class, e.g. "
                 "transformers.GPT2TokenizerFast(tokenizer_object=tok.backend_tokenizer), or save the model and "
                 "tokenizer to a folder and set it there)" if saved else f"in {model_dir / 'tokenizer_config.json'}")
        fix = (f"set \"tokenizer_class\": \"{BPE_TOKENIZER_CLASS[arch]}\" {where} "
               f"(it is {config.get('tokenizer_class')!r}), which makes the converter read tokenizer.json as a "
               "byte-level BPE" if arch in BPE_TOKENIZER_CLASS else
               "save the tokenizer's tokenizer.model beside it (SentencePiece), or plan compressed-tensors instead")
        return InputError(f"llama.cpp's convert_hf_to_gguf.py does not convert {model_dir}: it reads this "
                          f"architecture's ({arch}) tokenizer from tokenizer.model, a SentencePiece file the folder "
                          f"does not have (it said: {said}); its tokenizer is tokenizer.json: {fix}")
    return NotRepresentableError(f"llama.cpp's convert_hf_to_gguf.py could not convert {model_dir} (exit {code}): "
                                 f"{said} (its traceback is logged with --verbose)")


#: llama.cpp's vocabulary loader treats a model whose ``general.name`` contains one of these (lower-cased) as
#: Phi-3 and looks these tokens up (llama-vocab.cpp, ``_contains_any(model_name, {"phi-3", "phi3"})``): a
#: vocabulary without one of them does not load ("unordered_map::at"), whatever the architecture.
NAME_TOKEN_RULES = {"Phi-3": (("phi-3", "phi3"), ("</s>", "<unk>", "<s>", "<|endoftext|>"))}


def load_refusal(model_dir: Path, path: Path, said: str) -> Exception:
    """llama.cpp's refusal of the converter's file as a user reads it: what llama.cpp said, and the fix where the
    file's name or tokenizer is the cause (:data:`NAME_TOKEN_RULES`)."""
    from compressor.core.errors import InputError
    from compressor.output.gguf.naming import _field, _gguf

    reader = _gguf().GGUFReader(path)
    name = str(_field(reader, "general.name") or "")
    field = reader.fields.get("tokenizer.ggml.tokens")
    tokens = set(field.contents()) if field is not None else set()
    head = (f"llama.cpp does not load the F16 that its convert_hf_to_gguf.py made of {model_dir} (llama.cpp said: "
            f"{said}), so nothing can be planned from it")
    for model, (names, needed) in NAME_TOKEN_RULES.items():
        lacking = [t for t in needed if t not in tokens]
        if any(n in name.lower() for n in names) and lacking:
            return InputError(
                f"{head}: the file's general.name is {name!r}, and llama.cpp treats a model whose name contains "
                f"{' or '.join(repr(n) for n in names)} as {model} and looks up its tokens "
                f"{', '.join(repr(t) for t in needed)}; this tokenizer has no {', '.join(repr(t) for t in lacking)}. "
                "The converter takes the name from README.md's model_name, else config.json's _name_or_path, else "
                f"the folder's name ({model_dir.name!r}): rename the folder (or the name) to one without "
                f"{' or '.join(repr(n) for n in names)}, or add those tokens to the tokenizer")
    return InputError(f"{head}. The converter and llama.cpp disagree about this folder: check its config.json and "
                      "tokenizer, or plan compressed-tensors instead (output.formats: [compressed-tensors])")


def _folder_architecture(model_dir: Path) -> str:
    return str((_json(model_dir / "config.json").get("architectures") or ["?"])[0])


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def fetch(where: Path | None = None) -> Path:
    """Download the llama-cpp-python source distribution with pip (a package registry is all it needs) and keep
    its llama.cpp converter, ``conversion/`` package and gguf-py in ``where`` (default :func:`converter_dir`)."""
    import shutil
    import tarfile
    import tempfile

    where = Path(where or converter_dir())
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                       and m.name[len(prefix):].startswith(keep) and (m.isfile() or m.isdir())]
            try:
                tar.extractall(tmp, members=members, filter="data")
            except TypeError:  # a Python without extraction filters (before 3.10.12 / 3.11.4)
                tar.extractall(tmp, members=members)
        staged = where.with_name(where.name + ".tmp")
        shutil.rmtree(staged, ignore_errors=True)
        staged.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(Path(tmp) / prefix), staged)
        shutil.rmtree(where, ignore_errors=True)
        staged.rename(where)
    return where


if __name__ == "__main__":
    if missing() is None and "--force" not in sys.argv:
        print(f"llama.cpp's converter is in {converter_dir()}")
    else:
        print(f"llama.cpp's converter fetched into {fetch()}")
