"""Helpers of the viewer's tests: a synthetic model with markup in its vocabulary, graphs as the graph page shows
them; a live ``detjac view`` process and a headless Chromium come from :mod:`detjac.view.headless`.

The browser tests need the ``selenium`` package and Debian's ``chromium`` with its driver
(``apt-get install chromium chromium-driver``; ``make test`` installs them when it runs as root with
apt-get); ``browser_missing`` says what is lacking.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from detjac.store.testing import SyntheticModel, synthetic_model
from detjac.view.headless import detjac_command

SCRIPT_WORD = "<script>alert(1)</script>"  # a token and a prompt that must be shown as text, never run
MARKUP_WORD = "<b>bold</b>"
TEXTS = ["the oak tree grows", "a young cat plays in the sea", f"the {SCRIPT_WORD} harp {MARKUP_WORD} plays",
         "copper is a metal"]
INJECTED = '<img src=x onerror="document.title=\'injected\'">'  # a token text and labels of a graph: text only
GRAPH_PROMPT = "Copper, n. A"
NEURON_TEXTS = [f"Copper {INJECTED} <script>alert(1)</script> n. A metal", "Copper, n. A common metal"]  # an index's


def viewer_model() -> SyntheticModel:
    """The synthetic model with two words of markup in its vocabulary (so tokens and decoded tokens can hold them)."""
    base = synthetic_model(d_model=8, vocab=40)
    words = (*base.words[:-2], SCRIPT_WORD, MARKUP_WORD)
    return SyntheticModel(base.embedding, base.unembedding, base.final_norm, words)


def script_prompt(synthetic) -> str:
    """The id of the prompt holding :data:`SCRIPT_WORD`."""
    return next(pid for pid, truth in synthetic.prompts.items() if SCRIPT_WORD in truth.text)


def exported_prompts(synthetic) -> list[str]:
    """The two prompts the tests export: the one holding :data:`SCRIPT_WORD` and the first other one."""
    script = script_prompt(synthetic)
    return [script, next(pid for pid in synthetic.ids if pid != script)]


def copy_store(synthetic, folder: Path) -> Path:
    """A copy of a synthetic store's folder (for a command that writes analyses into it)."""
    return Path(shutil.copytree(synthetic.path, folder / synthetic.path.name))


def write_default_graph(out: Path) -> Path:
    """``detjac graph`` of :data:`GRAPH_PROMPT` on the default model (about 10 s) into ``out``."""
    done = subprocess.run(detjac_command("graph", "-p", GRAPH_PROMPT, "--out", str(out), "--max-nodes", "200"),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out


def stored_graphs(monkeypatch, store, graphs: dict) -> None:
    """Give the prompts of ``store`` the graphs ``graphs`` (prompt id -> graph JSON; None for the others) through
    ``StoredPrompt.graph()``, the reader the store's graphs come with, on the class its prompts are read as."""
    prompt = store.get(store.prompt_ids()[0])
    monkeypatch.setattr(type(prompt), "graph", lambda self: graphs.get(self.id), raising=False)


def kept_by_thresholds(graph: dict, node_t: float, edge_t: float, hidden: tuple[int, ...] = ()) -> tuple[set, list]:
    """What the graph page shows under its two thresholds and its position filter (docs/graphs.md, "In the
    viewer"), computed here on the JSON: tokens and logits always, a neuron while its influence is at most
    ``node_t`` and its position is not in ``hidden``; then the links between shown nodes, largest |weight| first,
    while the |weight| taken before them is below ``edge_t`` of their total."""
    nodes = {n["node_id"] for n in graph["nodes"] if n["feature_type"] in ("embedding", "logit")
             or (n["influence"] <= node_t + 1e-12 and n["ctx_idx"] not in hidden)}
    candidates = sorted((link for link in graph["links"] if link["source"] in nodes and link["target"] in nodes),
                        key=lambda link: -abs(link["weight"]))
    total, taken, links = sum(abs(link["weight"]) for link in candidates), 0.0, []
    for link in candidates:
        if edge_t < 1 and taken >= edge_t * total:
            break
        links.append(link)
        taken += abs(link["weight"])
    return nodes, links


def crossed_layers(graph: dict, link: dict) -> range:
    """The attention layers a link can cross (docs/graphs.md, head loadings): after its source's MLP (from layer 0
    for a token) up to its target's attention, inclusive (up to the last layer for a logit)."""
    kinds = {n["node_id"]: n for n in graph["nodes"]}
    source, target = kinds[link["source"]], kinds[link["target"]]
    first = 0 if source["feature_type"] == "embedding" else int(source["layer"]) + 1
    last = graph["metadata"]["info"]["n_layers"] - 1 if target["feature_type"] == "logit" else int(target["layer"])
    return range(first, last + 1)


def with_head_loadings(graph: dict, n_heads: int, top: int, seed: int = 0) -> dict:
    """A copy of ``graph`` whose ``top`` strongest links (by |weight|) carry synthetic ``head_loadings``: per layer
    they can cross, random loadings of every head plus the skip that makes the layer sum to the link's weight (the
    format `detjac graph --heads N` writes; the numbers are made up: this tests the viewer, not the engine)."""
    import json

    import numpy as np

    rng = np.random.default_rng(seed)
    out = json.loads(json.dumps(graph))
    for link in sorted(out["links"], key=lambda x: -abs(x["weight"]))[:top]:
        loads = {}
        for layer in crossed_layers(out, link):
            heads = rng.normal(size=n_heads) * abs(link["weight"]) / n_heads
            loads[str(layer)] = {**{str(h): float(w) for h, w in enumerate(heads)},
                                 "skip": float(link["weight"] - heads.sum())}
        link["head_loadings"] = loads
    return out
