"""The summaries ``benchmarks/real_findings.py`` takes from its support and the library
(``benchmarks.support.findings``, the layerwise spectra of ``detjac.analysis.spectra``, the lens resume check of
``detjac.runs``, its results file by ``benchmarks.support.shared_json``) and the committed
``benchmarks/results/real_models.json`` agree: the figures docs/real-models.md quotes are recomputed from the
per-prompt records, the controls of the ``u_1`` hit rate count what they say, and the layerwise spectra equal an
SVD's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.support import findings
from detjac.analysis.lens.lens_eval import wilson
from detjac.analysis.spectra import gram_left_spectrum
from detjac.machine import host

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
RESULTS = BENCH / "results" / "real_models.json"


def test_left_spectrum_is_the_svd():
    torch.manual_seed(0)
    op = (torch.randn(48, 1) @ torch.randn(1, 700) * 4 + torch.randn(48, 700)).double()
    orient = torch.randn(48, dtype=torch.float64)
    S, u1 = (torch.from_numpy(a) for a in gram_left_spectrum((op @ op.T).numpy(), orient.numpy()))
    U, ref, _ = torch.linalg.svd(op, full_matrices=False)
    assert torch.allclose(S, ref, rtol=0, atol=1e-12 * float(ref[0]))
    assert float(u1 @ orient) >= 0
    assert torch.allclose(u1.abs(), U[:, 0].abs(), atol=1e-10)
    assert S.shape == (48,)


def test_u1_controls_count_pairs_and_uncommon_predictions():
    rows = [  # predictions 7, 7, 7, 3, 5; each u_1 holds its own prediction except the last
        {"next_token_id": 7, "u1_top10": [7, 1], "u1_hit": True},
        {"next_token_id": 7, "u1_top10": [7, 3], "u1_hit": True},
        {"next_token_id": 7, "u1_top10": [2, 7], "u1_hit": True},
        {"next_token_id": 3, "u1_top10": [3, 9], "u1_hit": True},
        {"next_token_id": 5, "u1_top10": [1, 2], "u1_hit": False},
    ]
    out = findings.u1_controls(rows, common=1)
    # ordered pairs (p, q), q != p, with p's prediction in q's top 10: the three 7s find 7 in the other two 7s'
    # lists (6 pairs), the 3 is in the second row's list (1), the 5 in none
    assert out["other_prompts_u1_top10_rate"] == {"hits": 7, "n": 20, "rate": 7 / 20}
    assert out["frequent_predictions"] == [{"token_id": 7, "prompts": 3}]
    rest = out["uncommon_u1_top10_rate"]
    assert (rest["hits"], rest["n"], rest["rate"]) == (1, 2, 0.5)
    low, high = rest["ci95"]
    assert 0 < low < 0.5 < high < 1


def test_records_are_grouped_by_the_machine_that_computed_them():
    rows = [{"recon_detached": e, "seconds_detached": t, "seconds_ordinary": 1.0, **({"host": h} if h else {})}
            for e, t, h in ((1e-15, 10.0, None), (2e-15, 20.0, None), (6e-15, 30.0, "CPU A, 2 cores"))]
    out = findings.by_host(rows)
    assert list(out) == ["not recorded", "CPU A, 2 cores"]
    assert out["not recorded"]["prompts"] == 2 and out["not recorded"]["seconds_detached"] == 15.0
    assert out["not recorded"]["recon_detached"]["max"] == 2e-15
    assert out["CPU A, 2 cores"]["recon_detached"]["median"] == 6e-15
    assert host().endswith(" cores") and host() != " cores"


def test_wilson_interval_known_values():
    assert wilson(0, 40) == (0.0, pytest.approx(0.0876, abs=1e-4))  # detjac.analysis.lens.lens_eval's
    assert wilson(40, 40)[1] == 1.0  # rounding kept inside [0, 1]
    low, high = wilson(33, 40)
    assert (round(low, 3), round(high, 3)) == (0.680, 0.913)


def test_committed_summary_is_recomputed_from_the_records():
    results = json.loads(RESULTS.read_text(encoding="utf-8"))
    for name in ("smollm2", "gemma3"):
        entry = results[name]
        rows = entry["prompts"]
        assert rows, name
        for r in rows:  # every record says what the benchmark measures, consistently
            assert r["u1_hit"] == (r["next_token_id"] in r["u1_top10"]) and len(r["u1_top10"]) == 10
            assert r["recon_detached"] < 1e-12, (name, r["index"], r["recon_detached"])
            assert 8 <= len(r["token_ids"]) <= 64
        assert len({r["index"] for r in rows}) == len(rows), f"{name}: a prompt recorded twice"
        fresh = json.loads(json.dumps(findings.findings_summary(entry)))  # as written: floats round-trip exactly
        stored = entry["summary"]
        for key in ("prompts", "u1_top10_rate", "ordinary_u1_top10_rate", "random_top10_rate", "recon_detached",
                    "other_prompts_u1_top10_rate", "uncommon_u1_top10_rate", "by_host"):
            assert stored[key] == fresh[key], f"{name}: summary[{key!r}] is stale; run real_findings.py --summary"


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_docs_show_the_recorded_example(name, tmp_path):
    """docs/real-models.md shows the paper's example exactly as ``real_findings.py --example-table`` prints it
    from the committed record (decoded by the model's own tokenizer)."""
    from real_models import gemma3_path, smollm2_path

    from detjac.engine.checkpoints.gguf import gguf_tokenizer

    path = smollm2_path() if name == "smollm2" else gemma3_path(tmp_path)
    example = json.loads(RESULTS.read_text(encoding="utf-8"))[name]["example"]
    assert example["text"] == "The bridge out of Marin is the"
    table = findings.example_markdown(example, gguf_tokenizer(path))
    page = (BENCH.parent / "docs" / "real-models.md").read_text(encoding="utf-8")
    assert table in page, f"docs/real-models.md does not show {name}'s example as recorded; paste:\n{table}"


def test_docs_u1_table_is_recomputed_from_the_records():
    """Every cell of the `u_1` table in docs/real-models.md comes back from the first N records (by prompt index;
    N is the count its row states), so the page cannot drift from the results as they grow."""
    import re

    results = json.loads(RESULTS.read_text(encoding="utf-8"))
    page = (BENCH.parent / "docs" / "real-models.md").read_text(encoding="utf-8")
    rows = {"SmolLM2-135M": "smollm2", "Gemma 3 270M": "gemma3"}
    seen = set()
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] not in rows or len(cells) != 6:
            continue
        name = rows[cells[0]]
        seen.add(name)
        parsed = [re.fullmatch(r"(\d+)/(\d+) = ([\d.]+)(?: \[([\d.]+), ([\d.]+)\])?", c) for c in cells[1:]]
        assert all(parsed), f"unexpected cell in {line!r}"
        n = int(parsed[0][2])
        records = sorted(results[name]["prompts"], key=lambda r: r["index"])[:n]
        assert len(records) == n, f"the page states {n} records of {name}; the results hold {len(records)}"
        controls = findings.u1_controls(records)
        expected = [
            *(findings.findings_summary({"prompts": records, "skipped": [], "layerwise": [], "timing": {}})[key]
              for key in ("u1_top10_rate", "ordinary_u1_top10_rate", "random_top10_rate")),
            controls["other_prompts_u1_top10_rate"],
            controls["uncommon_u1_top10_rate"],
        ]
        for match, want in zip(parsed, expected, strict=True):
            assert (int(match[1]), int(match[2])) == (want["hits"], want["n"]), line
            assert float(match[3]) == round(want["rate"], 3), line
            if match[4] is not None:
                assert [float(match[4]), float(match[5])] == [round(x, 3) for x in want["ci95"]], line
    assert seen == {"smollm2", "gemma3"}, "docs/real-models.md lost its u_1 table"


def test_layerwise_output_agrees_with_the_float64_record():
    """Two computations of the same output J: the layerwise part's last row (float32, layer-streamed) and the
    prompt's record (float64, in memory) decode ``u_1`` to the same 10 tokens and give the same stable rank."""
    results = json.loads(RESULTS.read_text(encoding="utf-8"))
    for name in ("smollm2", "gemma3"):
        records = {r["index"]: r for r in results[name]["prompts"]}
        layerwise = results[name]["layerwise"]
        assert layerwise, name
        for entry in layerwise:
            out, rec = entry["layers"][-1], records[entry["index"]]
            assert out["layer"] == "output"
            assert out["u1_top10"] == rec["u1_top10"], (name, entry["index"])
            assert out["stable_rank"] == pytest.approx(rec["stable_rank"], rel=1e-4), (name, entry["index"])
            assert out["recon"] < 1e-5 and all(row["recon"] < 1e-5 for row in entry["layers"]), (name, entry["index"])


def test_lens_part_keeps_only_a_complete_lens_of_the_same_texts(tmp_path):
    """A stopped lens part resumes after its last finished ``jlens`` fit: a saved lens of exactly the fit texts is
    kept; one of other texts or of the conventions before (onto the final normed state), a damaged one or none is
    fitted again."""
    import hashlib

    import numpy as np

    from detjac.analysis.lens import LENS_VERSION, Lens, save_lens
    from detjac.runs import jlens_fitted_on

    texts = tmp_path / "fit.txt"
    texts.write_text("The first text\n\nThe second text\n", encoding="utf-8")  # a blank line is not a text
    digest = hashlib.sha256(json.dumps(["The first text", "The second text"]).encode()).hexdigest()
    eye = np.eye(3)[None]
    info = {"version": LENS_VERSION, "kind": "detached", "estimator": "jlens", "prompts_sha256": digest,
            "target": "final_block"}
    kept = save_lens(Lens(np.array([0]), eye, eye, np.array([2]), info), tmp_path / "kept.jlens")
    assert jlens_fitted_on(kept, texts)
    before = save_lens(Lens(np.array([0]), eye, eye, np.array([2]), {**info, "target": "every position"}),
                       tmp_path / "before.jlens")
    assert not jlens_fitted_on(before, texts)  # the estimator's conventions before: fitted again
    assert not jlens_fitted_on(tmp_path / "absent.jlens", texts)
    other = tmp_path / "other.txt"
    other.write_text("Another text\n", encoding="utf-8")
    assert not jlens_fitted_on(kept, other)
    (kept / "mean" / "c" / "0" / "0" / "0").write_bytes(b"damaged")
    assert not jlens_fitted_on(kept, texts)


def test_lens_evaluation_keeps_ranks_and_the_uncommon_table_counts_them(tmp_path):
    """The lens part keeps every prompt's rank of its prediction per method and layer (from ``lens_rows.csv``), and
    the second lens table recomputes top-1 / top-10 on the prompts whose prediction is not a frequent one."""
    header = "prompt,layer,method,rank,error,top,predicted\n"
    # 4 prompts predicting 7, 7, 3, 5; 2 layers; the logit lens finds only the 7s, the detached lens everything
    ranks = {"logit": [[1, 1], [1, 1], [40, 9], [60, 30]], "detached lens": [[2, 1], [5, 1], [1, 1], [11, 1]]}
    predicted = [7, 7, 3, 5]
    lines = [f"{p},{layer},{method},{grid[p][layer]},0.5,1 2 3,{predicted[p]}\n"
             for method, grid in ranks.items() for p in range(4) for layer in range(2)]
    (tmp_path / "lens_rows.csv").write_text(header + "".join(reversed(lines)))  # order of rows does not matter
    summary = [{"layer": str(layer), "method": method, "n": "4", "top1": str(sum(g[layer] == 1 for g in grid) / 4),
                "top10": str(sum(g[layer] <= 10 for g in grid) / 4)} for method, grid in ranks.items()
               for layer in range(2)]
    with open(tmp_path / "lens_summary.csv", "w", encoding="utf-8") as handle:
        handle.write("layer,method,n,top1,top10\n" + "".join(",".join(r.values()) + "\n" for r in summary))
    got = findings.lens_evaluation_ranks(tmp_path)
    assert got["ranks"] == ranks and got["predicted"] == predicted and got["layers"] == [0, 1]
    table = findings.lens_comparison_markdown({"fit_prompts": 3, "same-position": got}, common=1)
    first, second = table.split("The same on the ")
    assert "| 0 | 50 / 50 | 25 / 75 | – |" in first and "| 1 | 50 / 75 | 100 / 100 | – |" in first
    assert second.startswith("2 evaluation prompts whose prediction is not one of the 1 most frequent")
    assert "| 0 | 0 / 0 | 50 / 50 | – |" in second and "| 1 | 0 / 50 | 100 / 100 | – |" in second
    (tmp_path / "lens_rows.csv").write_text(header + "".join(lines[:-1]))  # a missing row raises, never reads as 0
    with pytest.raises(ValueError, match="not every prompt"):
        findings.lens_evaluation_ranks(tmp_path)


def test_docs_lens_page_shows_the_measured_comparison():
    """docs/lens.md shows each model's real-model lens comparison exactly as ``real_findings.py --lens-table``
    prints it from the committed results, for every model whose two estimators are measured (at least one)."""
    results = json.loads(RESULTS.read_text(encoding="utf-8"))
    page = (BENCH.parent / "docs" / "lens.md").read_text(encoding="utf-8")
    measured = [name for name in ("smollm2", "gemma3")
                if all(est in results[name].get("lens", {}) for est in ("same-position", "jlens"))]
    assert measured, "no model's lens comparison in the results"
    for name in measured:
        table = findings.lens_comparison_markdown(results[name]["lens"])
        assert table in page, f"docs/lens.md does not show {name}'s lens comparison as measured; paste:\n{table}"


def test_saving_one_model_keeps_what_another_process_saved(tmp_path):
    """Two processes, one per model, each holding a stale copy of the file: each save merges only its own model's
    entry (or, for the summary, only that key), and a second process on the same model is refused."""
    from benchmarks.support.shared_json import holding, load_entries, save_entry

    path = tmp_path / "real_models.json"
    mine, theirs = load_entries(path), load_entries(path)
    mine["smollm2"] = {"prompts": [{"index": 0}]}
    theirs["gemma3"] = {"prompts": [{"index": 5}]}
    save_entry(path, mine, "smollm2")
    save_entry(path, theirs, "gemma3")  # its copy has no smollm2: the file's is kept
    mine["smollm2"]["prompts"].append({"index": 1})
    save_entry(path, mine, "smollm2")
    theirs["smollm2"] = {"summary": {"prompts": 2}, "prompts": []}
    save_entry(path, theirs, "smollm2", "summary")
    got = json.loads(path.read_text())
    assert got["smollm2"]["prompts"] == [{"index": 0}, {"index": 1}]
    assert got["smollm2"]["summary"] == {"prompts": 2}
    assert got["gemma3"]["prompts"] == [{"index": 5}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["real_models.json", "real_models.json.lock"]  # no leftovers
    with holding(path, "smollm2"), pytest.raises(BlockingIOError, match="another process is running smollm2"):
        with holding(path, "smollm2"):
            pass
    with holding(path, "gemma3"), holding(path, "smollm2"):
        pass
