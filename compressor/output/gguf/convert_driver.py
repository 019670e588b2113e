"""Run llama.cpp's Hugging Face → GGUF converter on a folder and record where each weight's rows went.

Executed as a script, in a subprocess, by :func:`compressor.output.gguf.converter.convert`: the converter
imports the gguf-py it was written with (its own copy, put first on ``sys.path`` here), which may differ
from the gguf package the compressor process uses. It imports nothing of compressor.

    python convert_driver.py CONVERTER_DIR MODEL_DIR OUT.gguf LAYOUT_DIR OUTTYPE [PRE_TOKENIZER] [--model-name=ID]

Besides the file (exactly what ``convert_hf_to_gguf.py --outtype OUTTYPE`` writes), ``LAYOUT_DIR`` gets
``layout.json``: for every tensor of two or more dimensions the converter emits, the Hugging Face tensors
and rows it is made of. The converter is probed, not read: each weight is handed to the model class's own
``modify_tensors`` as a tensor of codes (its index among the checkpoint's tensors and its row number) in
two columns, and what comes out says which code landed on which row of which GGUF tensor — q/k
permutations, stacked experts, fused or split projections included, whatever the architecture's class does.
A tensor whose values the converter changes (a scale, an offset) or whose columns it moves is recorded as
``"changed"``: it is kept as the converter wrote it, not planned. A row order other than the identity is
saved as ``rows-N.npy``.

``PRE_TOKENIZER``: the ``tokenizer.ggml.pre`` to write when the converter does not recognise the tokenizer
(its table is keyed by a hash of known tokenizers' output, so a fine-tuned or newly trained byte-level BPE is
refused); compressor passes the one the tokenizer's own ``pre_tokenizer`` structure names
(:data:`compressor.output.gguf.metadata.PRE_TOKENIZERS`), or nothing, and the converter's refusal stands.
``--model-name``: the id (``org/name`` or a folder's name) ``general.name`` is made of, as the converter makes it
of a folder's name, for a folder saved under another name (a model object's).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

#: Bits of a code given to the row number: a tensor of up to 2^26 rows (a 262k vocabulary's embedding is 2^18).
ROW_BITS = 26
#: What the converter's main loop skips by name (``ModelBase.prepare_tensors``).
SKIPPED = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")


def main(argv: list[str]) -> int:
    named = [a.partition("=")[2] for a in argv if a.startswith("--model-name=")]
    conv_dir, model_dir, out, layout_dir, outtype, *pre = [a for a in argv if not a.startswith("--model-name=")]
    conv_dir, model_dir, layout_dir = Path(conv_dir), Path(model_dir), Path(layout_dir)
    sys.path[:0] = [str(conv_dir), str(conv_dir / "gguf-py")]
    import gguf
    import torch
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    logging.basicConfig(level=logging.WARNING, format="convert_hf_to_gguf: %(message)s")
    if pre:
        _known_pre_tokenizer(pre[0])
    hparams = ModelBase.load_hparams(model_dir, False)
    arch = get_model_architecture(hparams, ModelType.TEXT)
    cls = get_model_class(arch)
    ftype = {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
             "f32": gguf.LlamaFileType.ALL_F32}[outtype]
    # the converter's own heuristic for a folder's name (gguf.Metadata.apply_metadata_heuristic), on the given id
    name = gguf.Metadata.get_model_id_components(named[0])[0] if named else None
    kwargs = {"model_name": gguf.Metadata.id_to_title(name)} if name else {}
    with torch.inference_mode():
        layout = probe(cls(model_dir, ftype, Path(out), **kwargs), layout_dir)
        layout["architecture"] = gguf.MODEL_ARCH_NAMES[cls.model_arch]
        layout["hf_architecture"] = arch
        model = cls(model_dir, ftype, Path(out), **kwargs)
        model.write()
    (layout_dir / "layout.json").write_text(json.dumps(layout, indent=1))
    return 0


def _known_pre_tokenizer(name: str) -> None:
    """The converter's hash lookup of the pre-tokenizer, falling back to ``name`` where it finds none."""
    from conversion.base import TextModel

    lookup = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return lookup(self, tokenizer)
        except NotImplementedError:
            logging.getLogger("convert_driver").warning(
                "the tokenizer's hash is not in the converter's table; its pre_tokenizer structure is %r", name)
            return name

    TextModel.get_vocab_base_pre = get_vocab_base_pre


def probe(model, layout_dir: Path) -> dict:
    """``{"tensors": {gguf name: {"shape", "parts": [{"hf", "rows"}] | "changed"}}}``: each emitted tensor's
    rows (leading dimensions flattened), as runs of consecutive rows of one Hugging Face tensor."""
    import torch

    names = list(model.model_tensors)
    shapes = {}
    for name in names:
        shapes[name] = _shape(model.model_tensors[name])
    out: dict[str, dict] = {}
    for index, name in enumerate(names):
        if name.endswith(SKIPPED):
            continue
        shape = shapes[name]
        bid = next((int(p) for p in name.split(".") if p.isdecimal()), None)
        if len(shape) < 2:
            data = torch.zeros(shape, dtype=torch.float32)
        else:
            rows = 1
            for d in shape[:-1]:
                rows *= d
            codes = (torch.arange(rows, dtype=torch.float64) + float(index << ROW_BITS)).reshape(*shape[:-1], 1)
            data = torch.cat([codes, codes + 0.5], dim=-1)
        for new_name, t in model.modify_tensors(data, name, bid):
            if t.dim() >= 2:
                out[new_name] = _placement(t, names, shapes, len(out), layout_dir)
    return {"tensors": out, "row_bits": ROW_BITS}


def _shape(load) -> tuple[int, ...]:
    """A tensor's shape without reading its data where the converter's lazy tensor allows."""
    t = load()
    return tuple(int(d) for d in t.shape)


def _placement(t, names: list[str], shapes: dict, k: int, layout_dir: Path) -> dict:
    """Where ``t``'s rows came from; ``shape``: the tensor's own (the probe's leading dimensions, then the
    columns of the weight its rows are from)."""
    import numpy as np

    shape = [int(d) for d in t.shape]
    if t.dtype.is_floating_point and shape[-1] == 2:
        a = t[..., 0].reshape(-1).double().numpy()
        b = t[..., 1].reshape(-1).double().numpy()
        ok = np.all(b - a == 0.5) and np.all(a == np.floor(a)) and np.all(a >= 0)
    else:
        ok = False
    if not ok:
        return {"shape": shape, "parts": "changed"}
    codes = a.astype(np.int64)
    ids, rows = codes >> ROW_BITS, codes & ((1 << ROW_BITS) - 1)
    cuts = np.flatnonzero(np.diff(ids)) + 1
    parts = []
    for j, (start, stop) in enumerate(zip([0, *cuts], [*cuts, len(codes)])):
        r = rows[start:stop]
        if r[0] == 0 and np.array_equal(r, np.arange(len(r))):
            order = None
        else:
            order = f"rows-{k}-{j}.npy"
            np.save(layout_dir / order, r)
        parts.append({"hf": names[int(ids[start])], "rows": order, "count": int(stop - start)})
    return {"shape": shape[:-1] + [shapes[parts[0]["hf"]][-1]], "parts": parts}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
