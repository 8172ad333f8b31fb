"""A head's attention page: one ``detjac attention --out qk.json`` file, checked strictly and tied to its graph.

The file (docs/graphs.md, "Why a head attends where it does") holds the head's pattern at one query position and every
QK term: per key position ``{"position": j, "score": s, "probability": p, "terms": [{"query": Q, "key": K, "value":
v}, ...]}``. :func:`parse_attention` refuses anything else by name (a damaged file is an error, never numbers): the
fields' types, the model's identity complete (:data:`IDENTITY`), the layer and head within the model's, positions
inside the prompt and up to the query, components named as ``detjac attention`` names them
(``E``, ``B``, ``bias``, ``A{l}.{h}``, ``M{l}``, ``M{l}.{i}``, ``M{l}.rest``, ``B{l}``, each of a layer below the
head's), probabilities that sum to 1, each key's terms summing to its score, and its ``query_sums`` and ``key_sums``,
where the file has them, equal to its terms summed per component (a file written before they were recorded gets them
from its terms). :func:`check_belongs` refuses a file
of another model or another prompt than the graph's. The page gets each key's :data:`TERMS_SHOWN` largest terms and
what the others add up to (so a key's terms still sum to its score), and every component's sum on each side, from
which it lists the largest, the contrast of two keys and each table's remainder (:mod:`detjac.qk_sums`).
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path
from typing import Any

from ..attention_names import attention_file_name
from ..errors import InvalidArgumentError
from ..numerals import parse_index
from ..qk_sums import side_sums
from ..safe_json import read_json

TERMS_SHOWN = 16  # terms per key on the page, largest |value| first; the rest summed
COMPONENT = re.compile(r"^(?:E|B|bias|A(?P<a>\d{1,6})\.\d{1,6}|M(?P<m>\d{1,6})(?:\.(?:\d{1,9}|rest))?"
                       r"|B(?P<b>\d{1,6}))$", re.ASCII)  # ASCII: a Unicode digit is no layer (detjac.numerals)
SPECIAL = re.compile(r"^<[^<>\s]{1,40}>$")  # a leading special token (<s>, <|begin_of_text|>) the tokenizer adds
IDENTITY = {"family": str, "model_type": str, "name_or_path": str, "dtype": str, "n_layers": int, "n_heads": int,
            "d_model": int}  # what `detjac attention` records of every model (engine/tools/qk.py)
OPTIONAL = ("source", "weights_sha256")  # what the CLI adds: the model as named, a local checkpoint's SHA-256
MAX_SIZE = 1_000_000  # layers, heads, d_model: far more than any model has
COMPARED = ("family", "model_type", "n_layers", "n_heads", "d_model")  # against the graph's, wherever it has them


def page_key(layer: int, head: int, query: int) -> str:
    """The page's key: ``attention/L.H.Q`` (a static export's ``data/attention.L.H.Q.js``)."""
    return f"attention/{layer}.{head}.{query}"


def _int(data: dict[str, Any], name: str, where: str, below: int | None = None) -> int:
    value = data.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (below is not None and value >= below):
        bound = f" below {below}" if below is not None else ""
        raise InvalidArgumentError(f"Expected {name} to be a non-negative integer{bound} in {where}. "
                                   f"Got {str(value)[:40]!r}.")
    return value


def _num(value: Any, what: str, where: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidArgumentError(f"Expected {what} to be a finite number in {where}. Got {str(value)[:40]!r}.")
    return float(value)


def _component(name: Any, layer: int, where: str) -> str:
    found = COMPONENT.match(name) if isinstance(name, str) else None
    below = next((int(v) for v in found.groupdict().values() if v is not None), None) if found else None
    if found is None or (below is not None and below >= layer):
        raise InvalidArgumentError(f"Expected a component E, B, bias, A{{l}}.{{h}}, M{{l}}, M{{l}}.{{i}}, M{{l}}.rest "
                                   f"or B{{l}} with l below the head's layer {layer} in {where}. "
                                   f"Got {str(name)[:40]!r}.")
    return name


def _model(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """The file's model identity: every field of :data:`IDENTITY` of its type (sizes positive and below
    :data:`MAX_SIZE`), and the :data:`OPTIONAL` strings it has."""
    for name, kind in IDENTITY.items():
        value = raw.get(name)
        if not isinstance(value, kind) or isinstance(value, bool) or \
                (kind is int and not 0 < value < MAX_SIZE) or (name != "name_or_path" and not value):
            got = f"{name} {str(value)[:40]!r}" if name in raw else f"no {name}"
            raise InvalidArgumentError(f"Expected the model of {where} to record its {', '.join(IDENTITY)} (as "
                                       f"`detjac attention --out` writes them; sizes positive). Got {got}.")
    return {k: raw[k] for k in [*IDENTITY, *OPTIONAL] if isinstance(raw.get(k), str | int)
            and not isinstance(raw.get(k), bool)}


def parse_attention(raw: Any, where: str) -> dict[str, Any]:
    """The attention page's data from ``detjac attention``'s JSON object ``raw`` (module docstring).

    Returns
    -------
    dict
        ``layer``, ``head``, ``query_position``, ``tokens``, ``token_ids``, ``model`` (its string and integer fields),
        ``neurons``, ``score_error``, and ``keys``: per key ``position``, ``score``, ``probability``, ``terms``
        (``[[Q, K, value], ...]``, the :data:`TERMS_SHOWN` largest |value|), ``n_terms`` and ``rest`` (the other
        terms' sum), and ``query_sums`` and ``key_sums`` (``[[C, value], ...]``, every component, largest |value|
        first: each side's sums, computed from the terms, so that a file without them opens too).

    Raises
    ------
    InvalidArgumentError
        Anything that is not such a file (see the module docstring), naming what was expected and what was got.
    """
    if not isinstance(raw, dict) or not isinstance(raw.get("keys"), list) or not isinstance(raw.get("model"), dict):
        raise InvalidArgumentError(f"Expected the JSON `detjac attention --out` writes (an object with 'layer', "
                                   f"'head', 'model', 'tokens' and 'keys') in {where}. Got {type(raw).__name__} "
                                   f"with keys {sorted(raw)[:12] if isinstance(raw, dict) else []}.")
    tokens, ids = raw.get("tokens"), raw.get("token_ids")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens) or \
            not isinstance(ids, list) or len(ids) != len(tokens) or \
            not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise InvalidArgumentError(f"Expected 'tokens' (texts) and 'token_ids' (integers) of the same length in "
                                   f"{where}. Got {str(tokens)[:80]} and {str(ids)[:80]}.")
    model = _model(raw["model"], where)
    layer, head = _int(raw, "layer", where, below=model["n_layers"]), _int(raw, "head", where, below=model["n_heads"])
    query = _int(raw, "query_position", where, below=len(tokens))
    exact = model.get("dtype") == "float64"
    keys, seen, total_p, entries = [], set(), 0.0, {}
    for entry in raw["keys"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("terms"), list) or not entry["terms"]:
            raise InvalidArgumentError(f"Expected every key of {where} to be an object with 'position', 'score', "
                                       f"'probability' and a list of 'terms'. Got {str(entry)[:120]}.")
        j = _int(entry, "position", where, below=query + 1)
        if j in seen:
            raise InvalidArgumentError(f"Expected each key position once in {where}. Got {j} twice.")
        seen.add(j)
        score = _num(entry.get("score"), f"the score of key {j}", where)
        p = _num(entry.get("probability"), f"the probability of key {j}", where)
        if not 0.0 <= p <= 1.0:
            raise InvalidArgumentError(f"Expected probabilities between 0 and 1 in {where}. Got {p} at key {j}.")
        total_p += p
        terms = []
        for t in entry["terms"]:
            if not isinstance(t, dict):
                raise InvalidArgumentError(f"Expected each term of {where} to be an object with 'query', 'key' and "
                                           f"'value'. Got {str(t)[:80]}.")
            terms.append((_component(t.get("query"), layer, where), _component(t.get("key"), layer, where),
                          _num(t.get("value"), f"a term's value at key {j}", where)))
        keys.append((j, score, p, terms))
        entries[j] = entry
    if not keys:
        raise InvalidArgumentError(f"Expected at least one key position in {where}. Got none.")
    scale = max(1.0, max(abs(s) for _, s, _, _ in keys))
    for j, score, _, terms in keys:
        total = math.fsum(v for _, _, v in terms)
        if abs(total - score) > (1e-9 if exact else 1e-3) * scale:
            raise InvalidArgumentError(f"Expected the terms of each key to sum to its score in {where}. Got "
                                       f"{total:.8g} for a score of {score:.8g} at key {j}: the file is damaged or "
                                       f"was edited.")
    if abs(total_p - 1.0) > (1e-9 if exact else 1e-4):
        raise InvalidArgumentError(f"Expected the keys' probabilities to sum to 1 in {where}. Got {total_p:.8g}.")
    shown = []
    for j, score, p, terms in sorted(keys):
        query_sums, key_sums = _sums(entries[j], terms, (1e-9 if exact else 1e-3) * scale, where)
        terms.sort(key=lambda t: -abs(t[2]))
        shown.append({"position": j, "score": score, "probability": p,
                      "terms": [list(t) for t in terms[:TERMS_SHOWN]], "n_terms": len(terms),
                      "rest": math.fsum(v for _, _, v in terms[TERMS_SHOWN:]),
                      "query_sums": [list(x) for x in query_sums], "key_sums": [list(x) for x in key_sums]})
    error = raw.get("score_error")
    return {"layer": layer, "head": head, "query_position": query, "tokens": tokens, "token_ids": ids,
            "model": model, "neurons": raw.get("neurons") if isinstance(raw.get("neurons"), int) else 0,
            "score_error": error if isinstance(error, float) and math.isfinite(error) else None, "keys": shown}


def _sums(entry: dict[str, Any], terms: list[tuple[str, str, float]], bound: float, where: str
          ) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """A key's query-side and key-side sums (:func:`detjac.qk_sums.side_sums`), from its terms: a file written
    before ``detjac attention`` recorded them opens with the same sums. Where the file records them, they must be
    the terms' own, component by component (within ``bound``)."""
    sides = side_sums(terms)
    for name, computed in zip(("query_sums", "key_sums"), sides, strict=True):
        if name not in entry:
            continue
        recorded = entry[name]
        got = {x.get("component"): x.get("value") for x in recorded if isinstance(x, dict)} \
            if isinstance(recorded, list) else {}
        if set(got) != {c for c, _ in computed} or len(got) != len(recorded) or any(
                not isinstance(got[c], int | float) or isinstance(got[c], bool) or not abs(got[c] - v) <= bound
                for c, v in computed):
            raise InvalidArgumentError(f"Expected the {name} of each key to be its terms summed per component in "
                                       f"{where}. Got other components or values at key {entry['position']}: the "
                                       f"file is damaged or was edited.")
    return sides


def read_attention(path: str | Path) -> dict[str, Any]:
    """:func:`parse_attention` of the file ``path``.

    Raises
    ------
    InvalidArgumentError
        The file cannot be read, is not JSON (:mod:`detjac.safe_json`'s refusals included) or not such a file.
    """
    try:
        raw = read_json(path, kind="attention")
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"Expected an attention JSON file written by `detjac attention --out`. Got "
                                   f"{path}, which cannot be read as JSON ({exc}).") from exc
    return parse_attention(raw, str(path))


def graph_token_ids(nodes: list[dict[str, Any]]) -> dict[int, int]:
    """Position -> token id, from the graph's token nodes (``E_{id}_{pos}``)."""
    found = {}
    for n in nodes:
        parts = n["id"].split("_")
        token = parse_index(parts[1]) if n["type"] == "embedding" and len(parts) == 3 else None
        if token is not None:
            found[n["ctx"]] = token
    return found


def check_belongs(qk: dict[str, Any], graph: dict[str, Any], raw_info: dict[str, Any], where: str) -> None:
    """Refuse an attention file of another prompt or model than the graph's.

    Parameters
    ----------
    qk : dict
        :func:`parse_attention`'s result.
    graph : dict
        The graph page's data (:func:`~detjac.view.graph_page.graph_payload`).
    raw_info : dict
        The graph JSON's ``metadata.info`` as written (model name, weights' SHA-256, family, layers, ...).

    Raises
    ------
    InvalidArgumentError
        The prompts' tokens (texts or ids) differ, or the models do (weights' SHA-256 where both files have it,
        else the model's name; and :data:`COMPARED`, family, model type, layer and head counts and d_model,
        wherever the graph records them), or the layer is beyond the graph's.
    """
    tokens = graph["metadata"]["prompt_tokens"]
    ids = graph_token_ids(graph["nodes"])
    if qk["tokens"] != tokens or any(qk["token_ids"][k] != v for k, v in ids.items() if k < len(qk["token_ids"])):
        raise InvalidArgumentError(f"Expected an attention file of the graph's prompt ({len(tokens)} tokens, "
                                   f"{''.join(tokens)[:80]!r}) in {where}. Got one of {len(qk['tokens'])} tokens, "
                                   f"{''.join(qk['tokens'])[:80]!r}.")
    model = qk["model"]
    pairs = [("weights_sha256", "weights_sha256")] if raw_info.get("weights_sha256") and \
        model.get("weights_sha256") else [("model", "source")]
    for ours, theirs in [*pairs, *((name, name) for name in COMPARED)]:
        if raw_info.get(ours) is not None and model.get(theirs) is not None and \
                str(raw_info[ours]) != str(model[theirs]):
            raise InvalidArgumentError(f"Expected an attention file of the graph's model ({ours} "
                                       f"{str(raw_info[ours])[:64]}) in {where}. Got one of {theirs} "
                                       f"{str(model[theirs])[:64]}.")
    n_layers = raw_info.get("n_layers")
    if isinstance(n_layers, int) and qk["layer"] >= n_layers:
        raise InvalidArgumentError(f"Expected a layer below the graph's {n_layers} in {where}. Got {qk['layer']}.")


def command_prefix(graph: dict[str, Any]) -> str:
    """``detjac attention MODEL -p PROMPT`` for the graph's model and prompt (the prompt's text without a leading
    special token, which the tokenizer adds again); ``--layer``, ``--head`` and ``--out`` follow."""
    model = str(graph["metadata"]["info"].get("model") or "MODEL")
    return f"detjac attention {shlex.quote(model)} -p {shlex.quote(prompt_text(graph))}"


def prompt_text(graph: dict[str, Any]) -> str:
    """The text of the graph's prompt, without a leading special token (the tokenizer adds it again)."""
    tokens = list(graph["metadata"]["prompt_tokens"])
    if len(tokens) > 1 and SPECIAL.match(tokens[0]):
        tokens = tokens[1:]
    return "".join(tokens)


def attention_command(graph: dict[str, Any], layer: int, head: int, stem: str) -> str:
    """The ``detjac attention`` command that writes head ``(layer, head)``'s file for the graph's prompt and model,
    named so that ``detjac view STEM.json`` finds it beside the graph: ``STEM.qk.L{layer}.H{head}.json``."""
    out = attention_file_name(stem, layer, head)
    return f"{command_prefix(graph)} --layer {layer} --head {head} --out {shlex.quote(out)}"


def link_attention(graph: dict[str, Any], pages: dict[tuple[int, int, int], str], stem: str) -> None:
    """Give each row of the graph's heads panel its attention page (``page``: the key, preferring the logits'
    position as the query) or the command that makes its file (``command``); ``metadata.attention`` lists the
    pages' keys and ``metadata.attention_command`` (``prefix``, ``stem``) lets the page write any head's command."""
    logit_at = next((n["ctx"] for n in graph["nodes"] if n["type"] == "logit"), None)
    graph["metadata"]["attention_command"] = {"prefix": command_prefix(graph), "stem": stem}
    graph["metadata"]["attention"] = sorted(pages.values())  # the attention pages' keys
    for row in graph["metadata"]["heads"]["rows"]:
        found = sorted(((q != logit_at, q), key) for (layer, head, q), key in pages.items()
                       if (layer, head) == (row["layer"], row["head"]))
        row["page"] = found[0][1] if found else None
        row["command"] = None if found else attention_command(graph, row["layer"], row["head"], stem)
