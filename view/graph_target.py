"""The graph page's target panel: what a graph explains, and each token's exact signed contribution to it.

A graph's JSON says its target (``metadata.info.target``: the asked one, ``' Paris' - ' London'``, or none for the top
logits), the positions set aside (``info.aside``) and, for each logit node, every token's contribution to its value
through every path of the frozen system and the constants' (``info.token_contributions``, written by
:mod:`detjac.graphs.document`): over the tokens and the constants they sum to the value. The page lists them signed,
largest first, with that sum beside the value, so that a reader sees at once which tokens carry the prediction and
that nothing is missing (docs/graphs.md, "Targets"). Torch-free; model text is passed on as text.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import InvalidArgumentError
from .jsonable import finite_number

TARGET_MEANING = (
    "Each token's exact contribution to the target: the target's gradient at the token's input embedding, through "
    "every path of the frozen system, times that embedding. Signed: a negative contribution pushes the target down. "
    "Over the tokens and the constants (an affine family's biases) they sum to the target's value.")
ASIDE_MEANING = (
    "The first position is set aside: every number on this page is of the same frozen system without the first "
    "position's own contribution (its embedding and the constants added there), recomputed, not hidden.")


def target_panel(info: dict[str, Any], tokens: list[str], logits: dict[str, str], where: str) -> dict[str, Any] | None:
    """The target panel's data, or None for a graph without contributions (one written before them, or by another
    tool).

    Parameters
    ----------
    info : dict
        The JSON's ``metadata.info``.
    tokens : list of str
        The prompt's tokens.
    logits : dict
        Logit node id -> its label on the page.
    where : str
        Where the graph came from, for messages.

    Returns
    -------
    dict or None
        ``text`` (the asked target or None), ``aside`` (positions), ``meaning``, ``aside_meaning`` and ``targets``:
        per logit node its ``id``, ``label``, ``value``, ``constants``, ``sum`` (tokens and constants) and ``tokens``
        (``[position, token, contribution]`` each, in prompt order).

    Raises
    ------
    InvalidArgumentError
        Contributions that are not numbers, or not one per token and per logit node of the graph.
    """
    made = info.get("token_contributions")
    if made is None:
        return None
    bad = f"Expected metadata.info.token_contributions of {where} as 'targets' (logit node ids), 'values' (one " \
          f"number per token for each), 'constants' and 'target_values' (one number each)."
    if not isinstance(made, dict):
        raise InvalidArgumentError(f"{bad} Got {type(made).__name__}.")
    ids, values = made.get("targets"), made.get("values")
    constants, totals = made.get("constants"), made.get("target_values")
    lists = (ids, values, constants, totals)
    if not all(isinstance(v, list) for v in lists) or not len(ids) == len(values) == len(constants) == len(totals):
        lengths = [len(v) if isinstance(v, list) else None for v in lists]
        raise InvalidArgumentError(f"{bad} Got lists of lengths {lengths}.")
    targets = []
    for node, row, rest, total in zip(ids, values, constants, totals, strict=True):
        if node not in logits or not isinstance(row, list) or len(row) != len(tokens) or \
                not all(finite_number(v) for v in (*row, rest, total)):
            raise InvalidArgumentError(f"{bad} Got, for {str(node)[:40]!r}, {str(row)[:120]} (the graph has "
                                       f"{len(tokens)} tokens and logit nodes {sorted(logits)[:5]}).")
        targets.append({"id": node, "label": logits[node], "value": float(total), "constants": float(rest),
                        "sum": math.fsum([*map(float, row), float(rest)]),
                        "tokens": [[q, tokens[q], float(v)] for q, v in enumerate(row)]})
    aside = info.get("aside") or []
    if not isinstance(aside, list) or not all(isinstance(q, int) and 0 <= q < len(tokens) for q in aside):
        raise InvalidArgumentError(f"Expected metadata.info.aside of {where} as positions of its prompt. Got "
                                   f"{str(aside)[:80]}.")
    text = info.get("target")
    return {"text": str(text) if text is not None else None, "aside": aside, "meaning": TARGET_MEANING,
            "aside_meaning": ASIDE_MEANING, "targets": targets}
