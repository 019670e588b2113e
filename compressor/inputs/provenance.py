"""Where a model comes from, as a model card may state it: its Hub id, its license, its base model.

Only what the source itself says: a Hub id is the source's own name (never a local path or a
``pkg:`` name); the license comes from a GGUF's ``general.license`` or the source's model card
(``README.md`` front matter, local or already in the Hub cache — nothing is downloaded); a GGUF's
``general.base_model.*`` keys name the model it was converted from.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)

_HUB_URL = re.compile(r"^https?://huggingface\.co/([\w.-]+/[\w.-]+)/?$")


def source_metadata(src) -> dict:
    """``{"hub_id", "base_model", "license"}`` of a :class:`~compressor.inputs.load.ResolvedSource`
    (None where the source does not say)."""
    hub_id = src.hub_id()
    meta = {"hub_id": hub_id, "base_model": hub_id, "license": None}
    if src.gguf_file:
        meta.update(_gguf_metadata(Path(src.path) / src.gguf_file))
    card = _card_text(src)
    if card and meta["license"] is None:
        meta["license"] = _front_matter_license(card)
    return meta


def _gguf_metadata(path: Path) -> dict:
    out = {}
    try:
        from gguf import GGUFReader
    except ImportError:
        return out
    try:
        reader = GGUFReader(str(path))
        fields = {name: f for name, f in reader.fields.items() if name.startswith("general.")}

        def text(name: str) -> str | None:
            f = fields.get(name)
            if f is None or not f.data:
                return None
            return bytes(f.parts[f.data[0]]).decode("utf-8", "replace").strip() or None

        if text("general.license"):
            out["license"] = text("general.license")
        repo = text("general.base_model.0.repo_url") or ""
        m = _HUB_URL.match(repo)
        if m:
            out["base_model"] = m.group(1)
        elif text("general.base_model.0.organization") and text("general.base_model.0.name"):
            org, name = text("general.base_model.0.organization"), text("general.base_model.0.name")
            if re.fullmatch(r"[\w.-]+", org) and re.fullmatch(r"[\w.-]+", name):
                out["base_model_name"] = f"{org}/{name}"  # a name, not checked to be a Hub id: not base_model
    except Exception as e:  # noqa: BLE001 - metadata is optional; the model loaded already
        logger.debug("GGUF metadata of %s unreadable: %s", path, e)
    return out


def _card_text(src) -> str | None:
    if src.is_local and not src.gguf_file:
        readme = Path(src.path) / "README.md"
        return readme.read_text(encoding="utf-8", errors="replace") if readme.is_file() else None
    if src.hub_id():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(src.hub_id(), "README.md")
            if isinstance(cached, str):
                return Path(cached).read_text(encoding="utf-8", errors="replace")
        except Exception as e:  # noqa: BLE001
            logger.debug("no cached card for %s: %s", src.hub_id(), e)
    return None


def _front_matter_license(card: str) -> str | None:
    m = re.match(r"^---\s*\n(.*?)\n---\s*\n", card, re.S)
    if not m:
        return None
    import yaml

    try:
        data = yaml.safe_load(m.group(1)) or {}
    except yaml.YAMLError:
        return None
    lic = data.get("license") if isinstance(data, dict) else None
    return lic if isinstance(lic, str) and lic.strip() else None
