"""The layers tab: one kind of layerwise target (``layer``, ``attn``, ``mlp_local``, ...) across layers.

The numbers are ``detjac analyze layers``' with its defaults (:func:`detjac.analysis.layers.layer_table`,
:func:`detjac.analysis.layers.targets_heatmap`), for whatever kinds the prompt's target names hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..analysis import layer_table, piece_reader, targets_heatmap
from .jsonable import jsonable
from .prompt_page import kind_of, layer_kinds, token_pieces

if TYPE_CHECKING:
    from .readonly import ReadOnlyStore

LAYERS_K, LAYERS_TOP = 4, 10  # `detjac analyze layers`' defaults: --k, --top


def layers_payload(view: ReadOnlyStore, prompt_id: str, kind: str) -> dict[str, Any]:
    """The ``kind`` targets of one prompt, one row per layer, and the layer x token heatmap."""
    prompt = view.get(prompt_id)
    targets = [t for t in prompt.layerwise_targets if kind_of(t) == kind]
    rows = layer_table(view, [prompt_id], k=LAYERS_K, top=LAYERS_TOP, targets=targets)
    heat = targets_heatmap(view, prompt_id, targets)
    text = piece_reader(view)
    errors = prompt.attrs.get("layerwise") or {}
    return jsonable({
        "id": prompt_id, "kind": kind, "kinds": layer_kinds(prompt), "top": LAYERS_TOP, "k": LAYERS_K,
        "token": {"id": heat["token"], "text": text(heat["token"])}, "tokens": token_pieces(view, prompt),
        "rows": [{"target": r["target"], "layer": r["layer"], "sigma_1": r["sigma_1"],
                  "stable_rank": r["stable_rank"], "participation_ratio": r["participation_ratio"],
                  "n90": r["n90"], "n99": r["n99"], "u1_rank": r["u1_rank"], "first_sv": r["first_sv"],
                  "lens_rank": r["lens_rank"], "u1_tokens": [text(t) for t in r["u1_tokens"]],
                  "error": errors.get(r["target"], {}).get("reconstruction_error")} for r in rows],
        "heatmap": {"layers": heat["layers"], "u1_rank": heat["u1_rank"],
                    "contribution_rank": heat["contribution_rank"]}})
