"""The GPU check's graph step: an attribution graph with head loadings on the SmolLM2-shaped random checkpoint, in
float64, made on the device and, as its reference, on the same machine's CPU in the same run. The two must be the
same graph (the same neurons, logits and loaded links) with every number equal within float64 rounding: the
adjacency, the activations and the head loadings relative to their largest entry at most ``EXACT``, and the NaNs of
the loadings (layers a link does not cross) in the same places."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from detjac.graph_settings import GraphSettings

from .gpu_run import EXACT, Meter, Partial, checkpoint, random_ids, say, sizes


def relative_difference(got: np.ndarray, want: np.ndarray) -> float:
    """``max |got - want| / max |want|`` over the entries that are a number in both (the absolute difference where
    ``want`` is all zero; 0 where none is); where the NaNs lie is compared on its own."""
    both = ~(np.isnan(got) | np.isnan(want))
    if not both.any():
        return 0.0
    diff, scale = float(np.abs(got[both] - want[both]).max()), float(np.abs(want[both]).max())
    return diff / scale if scale else diff


def compare_graphs(got: Any, want: Any) -> dict[str, Any]:
    """How the device's graph ``got`` agrees with the CPU's ``want``: whether they hold the same nodes and loaded
    links and, if they do, the relative difference of each array and whether all are within float64 rounding."""
    same = (got.neurons.shape == want.neurons.shape and bool(np.array_equal(got.neurons, want.neurons))
            and list(got.logit_ids) == list(want.logit_ids)
            and bool(np.array_equal(got.head_loadings.links, want.head_loadings.links)))
    out: dict[str, Any] = {"same_nodes_and_links": same}
    if not same:
        out["equal_within_float64"] = False
        return out
    got_l, want_l = got.head_loadings.loadings, want.head_loadings.loadings
    out.update(adjacency=relative_difference(got.adjacency, want.adjacency),
               activations=relative_difference(got.activations, want.activations),
               head_loadings=relative_difference(got_l, want_l),
               nan_places_equal=bool(np.array_equal(np.isnan(got_l), np.isnan(want_l))))
    worst = max(out["adjacency"], out["activations"], out["head_loadings"])
    out["equal_within_float64"] = bool(worst <= EXACT and out["nan_places_equal"])
    return out


def step_graph_heads(args: argparse.Namespace, out: Partial) -> None:
    """The graph with head loadings on the device, then on the CPU; their agreement (:func:`compare_graphs`)."""
    from detjac.engine import load_engine
    from detjac.graphs import attribution_graph

    s = sizes(args.dry_run)
    folder = checkpoint(args, "smollm2")
    options = s["graph"]
    ids = random_ids(s["smollm2"]["vocab_size"], options["tokens"])
    graphs = {}
    for label, device in (("device", args.device), ("cpu", "cpu")):  # the device's first: the step's measurement
        meter = Meter(device)
        meter.reset()
        t0 = meter.now()
        engine = load_engine(str(folder), dtype="float64", device=device)
        graph = attribution_graph(engine, ids, GraphSettings(max_nodes=options["max_nodes"], heads=options["heads"]))
        seconds = meter.now() - t0
        graphs[label] = graph
        out.put(**{label: {"device": device, "seconds": seconds, "neurons": graph.n_neurons,
                           "links_loaded": int(graph.head_loadings.links.shape[0]),
                           "completeness": graph.worst_completeness, "head_loadings_error": graph.head_loadings.error,
                           **meter.peaks()}}, graph=options)
        say(f"graph-heads on {device}: {seconds:.1f} s, {graph!r}, head loadings error "
            f"{graph.head_loadings.error:.1e}")
        del engine
    agreement = compare_graphs(graphs["device"], graphs["cpu"])
    out.put(agreement=agreement)
    say(f"graph-heads: device against CPU {agreement}")
