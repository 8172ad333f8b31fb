"""Exact QK attribution (detjac.engine.qk_attribution) against the stock transformers model of every family.

The reference is independent of detjac's code: the stock model in float64 with a test-local eager attention that
keeps each call's query and key (after the q/k norms and the rotary embedding, as the stock modules made them) and
computes its softmax in float64, and every stock RMSNorm computing in float64 (the stock norms and eager softmax
compute in float32 inside, MISSION.md "Family facts"). Its score ``scaling · q_i · k_j`` is the explicit bilinear
sum the terms must add up to; its probabilities, and those of the stock model as it ships (eager, float32 inside:
within FLOAT32_NORM_BOUND), the output's. The tiny models' norm weights are perturbed (Gemma's ``1 + w`` differs
from ``w``) and the prompt is longer than every sliding window.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny_models import FAMILIES
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from detjac.engine import load_engine, qk_attribution
from detjac.engine.checkpoints.tiny import tiny_model
from detjac.engine.tools.qk import residual_decomposition
from detjac.errors import InvalidArgumentError, UnsupportedModelError

DECODERS = [t for t in FAMILIES if t != "bert"]
STOCK = "detjac_test_stock_qk"
CASES = ((2, 1, -1), (1, 3, 6))  # (layer, head, query): a sliding layer's window ends before the last query
SCORE_BOUND = 1e-12  # |sum of terms - stock score|, relative to the largest |score|
PROBABILITY_BOUND = 1e-12  # against the stock probabilities, norms in float64
FLOAT32_NORM_BOUND = 1e-6  # against the stock model as it ships (norms, softmax float32 inside: <= 1.5e-7 measured)


def _rms64(module: torch.nn.Module) -> Any:
    """An RMSNorm's forward in float64: ``x / rms(x) · w`` (Gemma: ``1 + w``)."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    offset = 1.0 if type(module).__name__.startswith("Gemma") else 0.0
    return lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + module.weight)


def _stock(model: torch.nn.Module, ids: list[int], exact_norms: bool) -> dict[str, Any]:
    """The stock model's pass: its attention probabilities and hidden states; with ``exact_norms`` its norms and
    softmaxes in float64 and each attention call's (query, key, scaling, softcap) by layer, else as it ships
    (eager attention)."""
    seen: list[tuple[torch.Tensor, torch.Tensor, float | None, float | None]] = []

    def keep(module: Any, query: Any, key: Any, value: Any, mask: Any, scaling: Any = None, softcap: Any = None,
             **_: Any) -> Any:  # eager attention, its softmax in float64 (the stock one casts to float32)
        seen.append((query, key, scaling, softcap))
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        scores = query @ key.transpose(2, 3) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores + mask[:, :, :, : key.shape[-2]], dim=-1)
        return (probs @ value).transpose(1, 2).contiguous(), probs

    AttentionInterface.register(STOCK, keep)
    AttentionMaskInterface.register(STOCK, eager_mask)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")] if exact_norms else []
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None),
                                                                             "_attn_implementation")}.values()
    before = [(c, c._attn_implementation) for c in configs]
    try:
        for m in norms:
            m.forward = _rms64(m)
        for c, _ in before:
            c._attn_implementation = STOCK if exact_norms else "eager"
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_attentions=True, output_hidden_states=True, use_cache=False)
    finally:
        for m in norms:
            del m.forward
        for c, impl in before:
            c._attn_implementation = impl
    return {"qk": seen, "attentions": out.attentions, "hidden": out.hidden_states}


def _score(stock: dict[str, Any], layer: int, head: int, i: int) -> torch.Tensor:
    query, key, scaling, _ = stock["qk"][layer]
    kv = head // (query.shape[1] // key.shape[1])
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return (query[0, head, i] @ key[0, kv].T) * scaling  # (n,)


@pytest.fixture(scope="module", params=DECODERS)
def family_case(request: pytest.FixtureRequest, prompt_ids: list[int]) -> dict[str, Any]:
    model = tiny_model(request.param, seed=7)
    results = {case: qk_attribution(model, prompt_ids, case[0], case[1], query=case[2]) for case in CASES}
    return {"type": request.param, "model": model, "results": results,
            "stock": _stock(model, prompt_ids, exact_norms=True),
            "stock_float32_norms": _stock(model, prompt_ids, exact_norms=False)}


@pytest.mark.parametrize("case", CASES)
def test_terms_sum_to_the_stock_score(family_case: dict[str, Any], case: tuple[int, int, int]) -> None:
    layer, head, _ = case
    res = family_case["results"][case]
    want = _score(family_case["stock"], layer, head, res.query_position)
    scale = float(want[[k["position"] for k in res.keys]].abs().max())
    worst = 0.0
    for key in res.keys:
        total = sum(t["value"] for t in key["terms"])
        worst = max(worst, abs(total - float(want[key["position"]])) / scale, abs(key["score"] - total) / scale)
    assert worst < SCORE_BOUND, f"{family_case['type']}: terms vs stock score {worst:.2e}"
    assert res.score_error < SCORE_BOUND
    assert all(len(k["terms"]) == len(res.query_components) ** 2 for k in res.keys)  # every pair listed
    assert ("bias" in res.query_components) == (family_case["type"] in ("gpt2", "qwen2"))  # q/k constants


@pytest.mark.parametrize("case", CASES)
def test_each_side_sums_to_the_stock_score(family_case: dict[str, Any], case: tuple[int, int, int]) -> None:
    """Each query-side component's marginal (its terms summed over every key-side component), and each key-side
    one's, add up to the stock score, and each equals its own terms' sum."""
    layer, head, _ = case
    res = family_case["results"][case]
    want = _score(family_case["stock"], layer, head, res.query_position)
    scale = float(want[[k["position"] for k in res.keys]].abs().max())
    for key in res.keys:
        for side, name in (("query_sums", "query"), ("key_sums", "key")):
            sums = {s["component"]: s["value"] for s in key[side]}
            assert len(sums) == len(key[side]) == len(res.query_components)  # one row per component
            grouped: dict[str, float] = {}
            for t in key["terms"]:
                grouped[t[name]] = grouped.get(t[name], 0.0) + t["value"]
            assert max(abs(sums[c] - grouped[c]) for c in sums) / scale < SCORE_BOUND
            total = sum(sums.values())
            assert abs(total - float(want[key["position"]])) / scale < SCORE_BOUND, (family_case["type"], side)
            values = [abs(s["value"]) for s in key[side]]
            assert values == sorted(values, reverse=True)


@pytest.mark.parametrize("case", CASES)
def test_a_contrast_splits_the_stock_score_difference_on_each_side(family_case: dict[str, Any],
                                                                   case: tuple[int, int, int]) -> None:
    """The attended key against every other key: each side's per-component differences add up to the difference of
    the stock scores; by default the attended key is the most attended and the other the next-most-attended."""
    layer, head, _ = case
    res = family_case["results"][case]
    want = _score(family_case["stock"], layer, head, res.query_position)
    scale = float(want[[k["position"] for k in res.keys]].abs().max())
    by_p = sorted(res.keys, key=lambda k: (-k["probability"], k["position"]))
    default = res.contrast()
    assert (default["key"], default["other"]) == (by_p[0]["position"], by_p[1]["position"])
    for other in by_p[1:]:
        got = res.contrast(by_p[0]["position"], other["position"])
        difference = float(want[by_p[0]["position"]] - want[other["position"]])
        assert abs(got["difference"] - difference) / scale < SCORE_BOUND
        for side in ("query_sums", "key_sums"):
            total = sum(s["value"] for s in got[side])
            assert abs(total - difference) / scale < SCORE_BOUND, (family_case["type"], side, other["position"])
            values = [abs(s["value"]) for s in got[side]]
            assert values == sorted(values, reverse=True)
        first = got["query_sums"][0]  # a row is the component's marginal at the key minus at the other key
        marginal = {p: {s["component"]: s["value"] for s in k["query_sums"]} for p, k in
                    ((by_p[0]["position"], by_p[0]), (other["position"], other))}
        assert first["value"] == marginal[by_p[0]["position"]][first["component"]] - \
            marginal[other["position"]][first["component"]]


def test_a_contrast_refuses_keys_the_query_does_not_attend_to(llama: torch.nn.Module, prompt_ids: list[int]) -> None:
    res = qk_attribution(llama, prompt_ids, 1, 0, query=3)
    with pytest.raises(InvalidArgumentError, match=r"^Expected the other key to be a key position the query attends "
                                                   r"to \(0 to 3, as the mask allows\)\. Got 5\.$"):
        res.contrast(0, 5)
    with pytest.raises(InvalidArgumentError, match="^Expected two different key positions to contrast. Got 2 twice."):
        res.contrast(2, 2)
    with pytest.raises(InvalidArgumentError, match="^Expected at least two key positions to contrast. Got 1"):
        qk_attribution(llama, prompt_ids, 1, 0, query=0).contrast()


@pytest.mark.parametrize("case", CASES)
def test_probabilities_and_allowed_keys_are_the_stock_models(family_case: dict[str, Any],
                                                             case: tuple[int, int, int]) -> None:
    layer, head, _ = case
    res = family_case["results"][case]
    for stock, bound in ((family_case["stock"], PROBABILITY_BOUND),
                         (family_case["stock_float32_norms"], FLOAT32_NORM_BOUND)):
        row = stock["attentions"][layer][0, head, res.query_position]
        assert [k["position"] for k in res.keys] == row.nonzero()[:, 0].tolist()  # causal, windows
        got = torch.tensor([k["probability"] for k in res.keys], dtype=row.dtype)
        assert float((got - row[row != 0]).abs().max()) < bound


def test_components_sum_to_the_stock_residual(family_case: dict[str, Any], prompt_ids: list[int]) -> None:
    comps, residual = residual_decomposition(family_case["model"], prompt_ids, 2)
    stock = family_case["stock"]["hidden"][2][0]
    assert float((comps.total() - stock).norm() / stock.norm()) < 1e-13
    assert float((comps.total() - residual).norm() / residual.norm()) < 1e-14
    names = [n[0] for n in comps.names]
    heads = family_case["model"].config.get_text_config().num_attention_heads
    assert names[0] == "E" and {f"A1.{h}" for h in range(heads)} | {"M0", "M1"} <= set(names)
    assert ("B0" in names) == (family_case["type"] in ("gpt2", "qwen2"))
    assert ("B" in names) == (family_case["type"] == "gpt2")  # learned positions


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gemma3_text", "olmoe"])
def test_neurons_split_each_mlp_exactly(model_type: str, prompt_ids: list[int]) -> None:
    model = tiny_model(model_type, seed=7)
    whole = qk_attribution(model, prompt_ids, 2, 0)
    split = qk_attribution(model, prompt_ids, 2, 0, neurons=3)
    assert split.score_error < SCORE_BOUND
    for a, b in zip(whole.keys, split.keys, strict=True):
        assert a["score"] == b["score"]
        for layer in (0, 1):  # the neuron slots and the rest carry M{l}'s terms against the key's E
            want = next(t["value"] for t in a["terms"] if t["query"] == f"M{layer}" and t["key"] == "E")
            got = [t["value"] for t in b["terms"] if t["query"].startswith(f"M{layer}.") and t["key"] == "E"]
            assert len(got) == 4 and abs(sum(got) - want) <= 1e-12 * max(1.0, abs(a["score"]))
    assert {f"M1.{i}" for i in range(200)} & set(split.query_components)
    assert "M1.rest" in split.query_components


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return tiny_model("llama", seed=7)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"layer": 3, "head": 0}, "Expected a layer in [0, 2] (the model has 3 layers). Got 3."),
    ({"layer": -1, "head": 0}, "Expected a layer in [0, 2]"),
    ({"layer": 0, "head": 4}, "Expected a head in [0, 3] (the model has 4 query heads per layer). Got 4."),
    ({"layer": 0, "head": 0, "query": 13}, "Expected a position in [-13, 13). Got 13"),
    ({"layer": 0, "head": 0, "neurons": -1}, "Expected neurons to be a non-negative integer. Got -1."),
    ({"layer": 1, "head": 0, "neurons": 49}, "Expected neurons from 0 to 48"),
])
def test_bad_input_is_refused_by_name(llama: torch.nn.Module, prompt_ids: list[int], kwargs: dict[str, Any],
                                      message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=None) as err:
        qk_attribution(llama, prompt_ids, **kwargs)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_encoder_and_streamed_engine_are_refused(prompt_ids: list[int], llama_checkpoint: Any) -> None:
    with pytest.raises(UnsupportedModelError, match="Expected a causal decoder family .* Got BERT"):
        qk_attribution(tiny_model("bert", seed=7), prompt_ids, 0, 0)
    with pytest.raises(InvalidArgumentError, match="Expected an in-memory engine .* Got a StreamedEngine"):
        qk_attribution(load_engine(llama_checkpoint, streamed=True), prompt_ids[:5], 0, 0)
