"""Which algorithm a draft checkpoint folder is for, read from its config and key names.

``speculum generate --draft DIR`` without ``--algorithm`` (and ``speculum.generate(draft=...)``
without ``algorithm``) decodes with the algorithm the draft was made for. Each loader's own
recognition decides: ``block_draft``'s architecture names (DFLASH, DSPARK), ``frozen_kv``'s
architecture, ``num_nextn_predict_layers > 1`` (multi-layer EAGLE), ``draft_loading``'s layouts
(EAGLE, EAGLE-3, MTP) and, last, any target architecture ``load_model`` reads (a standalone
small-LM draft).
"""

from __future__ import annotations

from pathlib import Path

from speculum.models import block_draft, frozen_kv
from speculum.models.config import SUPPORTED_ARCHITECTURES, read_json_object
from speculum.models.draft_loading import LAYOUTS, _read_weights, detect_layout
from speculum.models.loading import CheckpointError

__all__ = ["UnknownDraft", "draft_algorithm"]


class UnknownDraft(ValueError):
    """A draft folder whose algorithm cannot be told from its config and weights."""


def draft_algorithm(folder: str | Path) -> str:
    """The algorithm (a name of ``speculum.pipelines.ALGORITHMS``) the draft in ``folder`` is
    for. Raises ``CheckpointError`` for a folder without ``config.json`` or weights and
    :class:`UnknownDraft`, naming ``--algorithm``, when no layout matches."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"draft folder {folder} has no config.json (or does not exist)")
    raw = read_json_object(folder / "config.json")
    archs = raw.get("architectures") or [None]
    if raw.get("speculators_model_type") in block_draft.ALGORITHMS:
        return raw["speculators_model_type"]  # its loader explains why it cannot be read
    if archs[0] in block_draft._READ_AS:
        return block_draft._READ_AS[archs[0]]
    if archs[0] == frozen_kv.ARCHITECTURE:
        return "frozen_kv_mtp"
    if int(raw.get("num_nextn_predict_layers") or 0) > 1:
        return "multi_layer_eagle"
    found, kind = _read_weights(folder)
    layout = detect_layout(raw, found, kind)
    if layout is not None:
        return LAYOUTS[layout]
    if archs[0] in SUPPORTED_ARCHITECTURES:
        return "standalone"
    raise UnknownDraft(
        f"cannot tell which algorithm the draft in {folder} is for (architectures "
        f"{raw.get('architectures')}, no EAGLE, EAGLE-3, MTP or block-draft layout); pass "
        "--algorithm NAME"
    )
