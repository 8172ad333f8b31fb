"""The Jacobian-lens artifact format both ways (``detjac lens export``, :func:`detjac.runs.read_lens`): round trips,
the reference's fit checkpoint, a lens file in a Hugging Face cache laid out as the hub lays it out, and every
refusal (a pickled object, wrong keys, non-finite values, sizes that disagree, a model of another width or depth)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from detjac.analysis import FINAL_BLOCK, LENS_VERSION, Lens, save_lens
from detjac.cli.main import main
from detjac.errors import CheckpointError, InvalidArgumentError, StoreFormatError
from detjac.runs import artifact_lens, export_lens, read_lens
from tests.hub_cache import fabricate_hub_cache

D, N_LAYERS = 256, 4  # the default model's width and depth


def _lens(target: str = FINAL_BLOCK, layers: tuple[int, ...] = (0, 1, 2), d: int = D, seed: int = 0) -> Lens:
    rng = np.random.default_rng(seed)
    mean = np.stack([np.eye(d) + 0.1 * rng.standard_normal((d, d)) for _ in layers])
    info = {"version": LENS_VERSION, "kind": "detached", "estimator": "jlens", "target": target, "n_prompts": 5,
            "n_layers": N_LAYERS, "model": {"model_id": "default", "weights_sha256": None},
            "prompts_sha256": "ab" * 32, "skip_first_positions": 16, "max_seq_len": 128}
    return Lens(np.array(layers), mean, mean**2, np.full(len(layers), 5), info)


def test_an_exported_lens_is_the_reference_format_and_reads_back(tmp_path) -> None:
    lens = _lens(layers=(0, 1, 2, 3))
    out = export_lens(lens, tmp_path / "lens.pt")
    payload = torch.load(out, weights_only=True)
    assert set(payload) == {"J", "n_prompts", "source_layers", "d_model", "metadata"}
    assert payload["source_layers"] == [0, 1, 2] and sorted(payload["J"]) == [0, 1, 2]  # the last layer left out
    assert payload["d_model"] == D and payload["n_prompts"] == 5 and payload["J"][1].dtype == torch.float16
    ours = payload["metadata"]["detjac"]
    assert set(payload["metadata"]) == {"detjac"} and ours["kind"] == "detached" and ours["estimator"] == "jlens"
    assert ours["skip_first_positions"] == 16 and ours["prompts_sha256"] == "ab" * 32 and ours["left_out_layers"] == [3]
    back = artifact_lens(out)
    assert back.before_norm and back.kind == "detached" and list(back.layers) == [0, 1, 2]
    assert np.abs(back.operator(1) - lens.operator(1)).max() <= 1e-3 * np.abs(lens.operator(1)).max()  # float16
    assert np.isnan(back.second_moment).all()  # an artifact keeps no spread: unknown, not zero
    exact = artifact_lens(export_lens(lens, tmp_path / "f32.pt", dtype="float32"))
    assert np.abs(exact.operator(2) - lens.operator(2)).max() <= 1e-6 * np.abs(lens.operator(2)).max()
    assert not list(tmp_path.glob(".*.tmp"))  # written aside, then renamed


def test_a_lens_onto_the_normed_state_is_exported_divided_by_the_final_norm_gain(tmp_path) -> None:
    lens = _lens(target="to_output")
    with pytest.raises(InvalidArgumentError, match="final norm gain"):
        export_lens(lens, tmp_path / "a.pt")
    gain = np.linspace(0.5, 2.0, D)
    with pytest.raises(InvalidArgumentError, match="non-zero"):
        export_lens(lens, tmp_path / "a.pt", gain=np.where(np.arange(D) == 3, 0.0, gain))
    back = artifact_lens(export_lens(lens, tmp_path / "a.pt", gain=gain, dtype="float32"))
    want = lens.operator(0) / gain[:, None]
    assert np.abs(back.operator(0) - want).max() <= 1e-6 * np.abs(want).max()
    h = np.random.default_rng(1).standard_normal(D)
    read = back.apply(0, h)
    normed = gain * read / np.sqrt(np.mean(read**2))  # what the reference's readout does: norm(J h)
    assert np.abs(normed / np.linalg.norm(normed) - lens.apply(0, h) / np.linalg.norm(lens.apply(0, h))).max() < 1e-6


def test_export_refuses_to_overwrite_without_force(tmp_path) -> None:
    saved = save_lens(_lens(), tmp_path / "texts.jlens")
    out = tmp_path / "texts.pt"
    first = CliRunner().invoke(main, ["lens", "export", str(saved), str(out)])
    assert first.exit_code == 0, first.output
    assert "layers 0..2 (3), float16: written to" in first.output
    again = CliRunner().invoke(main, ["lens", "export", str(saved), str(out)])
    assert again.exit_code == 1 and "which exists (--force replaces it)" in again.output
    forced = CliRunner().invoke(main, ["lens", "export", str(saved), str(out), "--force", "--dtype", "float32"])
    assert forced.exit_code == 0 and torch.load(out, weights_only=True)["J"][0].dtype == torch.float32
    with pytest.raises(InvalidArgumentError, match="Got a folder"):
        export_lens(_lens(), tmp_path, force=True)
    applied = CliRunner().invoke(main, ["lens", "apply", str(out), "--prompt", "Oak, n. A tree of", "--no-exact"])
    assert applied.exit_code == 0, applied.output
    assert applied.output.count("detached lens") == 3  # layers 0..2 read from the file


def test_a_fit_checkpoint_is_read_as_its_mean(tmp_path) -> None:
    lens = _lens()
    path = tmp_path / "ckpt.pt"
    torch.save({"jacobian_sum": {layer: torch.from_numpy(7 * lens.operator(layer)).float() for layer in (0, 1, 2)},
                "n_done": 7, "next_idx": 7, "source_layers": [0, 1, 2], "target_layer": 3, "skip_first": 16}, path)
    back = read_lens(path)
    assert back.info["artifact"] == "fit checkpoint" and list(back.count) == [7, 7, 7] and back.kind == "ordinary"
    assert np.abs(back.operator(2) - lens.operator(2)).max() <= 1e-5 * np.abs(lens.operator(2)).max()
    torch.save({"jacobian_sum": {0: torch.eye(D)}, "n_done": 0}, path)
    with pytest.raises(StoreFormatError, match="Expected 'n_done' to be a positive integer .* Got 0"):
        read_lens(path)


def test_a_lens_is_read_from_the_hugging_face_cache_offline(tmp_path, monkeypatch) -> None:
    lens = _lens()
    data = export_lens(lens, tmp_path / "x.pt", dtype="float32").read_bytes()
    cache = tmp_path / "hub"
    fabricate_hub_cache(cache, "someorg/jacobian-lens", tmp_path, files={"default_jacobian_lens.pt": data})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    back = read_lens("someorg/jacobian-lens:default_jacobian_lens.pt")
    assert np.abs(back.operator(0) - lens.operator(0)).max() <= 1e-6 * np.abs(lens.operator(0)).max()
    assert back.info["source"].endswith("default_jacobian_lens.pt") and "snapshots" in back.info["source"]
    with pytest.raises(CheckpointError, match="Expected other.pt of someorg/jacobian-lens .*no such file"):
        read_lens("someorg/jacobian-lens:other.pt")
    with pytest.raises(CheckpointError, match="Got no models--someorg--absent: fetch it with `hf download"):
        read_lens("someorg/absent:default_jacobian_lens.pt")


class Opaque:  # a pickled object: torch.load(weights_only=True) must refuse to build it
    pass


@pytest.mark.parametrize(("payload", "message"), [
    ({"J": {0: torch.eye(D)}, "d_model": D}, "Expected 'n_prompts' to be a positive integer"),
    ({"J": {0: torch.eye(D)}, "n_prompts": 2, "d_model": D + 1},
     f"Expected d_model to be the matrices' size \\({D}\\)"),
    ({"J": {0: torch.eye(D), 1: torch.eye(D)}, "n_prompts": 2, "d_model": D, "source_layers": [0]},
     "Expected source_layers to list the layers of 'J' \\(\\[0, 1\\]\\)"),
    ({"J": {0: torch.full((D, D), float("nan"))}, "n_prompts": 2, "d_model": D}, f"Got {D * D} non-finite values"),
    ({"J": {0: torch.zeros(D, D + 1)}, "n_prompts": 2, "d_model": D}, "square .* Got \\(256, 257\\)"),
    ({"J": {0: torch.eye(D), 1: torch.eye(8)}, "n_prompts": 2, "d_model": D}, "of one shape"),
    ({"J": {"a": torch.eye(D)}, "n_prompts": 2, "d_model": D}, "Expected layer indices"),
    ({"weights": torch.eye(D)}, "Expected a Jacobian-lens artifact .* Got \\['weights'\\]"),
    ({"J": {0: Opaque()}, "n_prompts": 2, "d_model": D}, "readable by torch.load\\(weights_only=True\\)"),
    ({"J": {0: torch.zeros(1, 1).expand(30000, 30000)}, "n_prompts": 2, "d_model": 30000},
     "Got \\(30000, 30000\\) \\(900000000 values\\) over 4 bytes of storage \\(strides \\(0, 0\\)\\), which would "
     "expand to 6.7 GiB"),
    ({"J": {0: torch.eye(D), 1: torch.zeros(D).expand(D, D)}, "n_prompts": 2, "d_model": D}, "over 1024 bytes"),
    ({"J": {0: torch.empty(D, D, device="meta")}, "n_prompts": 2, "d_model": D}, "Got a meta-device tensor"),
    ({"J": dict.fromkeys(range(50), torch.eye(D)), "n_prompts": 2, "d_model": D},
     f"Got 50 matrices \\({50 * D * D * 4} bytes\\) over 1 storage of {D * D * 4} bytes"),
    ({"J": {0: torch.eye(D, dtype=torch.int64)}, "n_prompts": 2, "d_model": D}, "floating-point .* Got dtype int64"),
    ({"J": {0: torch.eye(D, dtype=torch.complex64)}, "n_prompts": 2, "d_model": D}, "Got dtype complex64"),
], ids=["no-count", "d_model", "source-layers", "non-finite", "not-square", "sizes", "layer-key", "keys", "pickle",
        "stride-0", "stride-0-row", "meta", "shared", "int", "complex"])
def test_a_malformed_artifact_is_refused_in_one_line(tmp_path, payload, message) -> None:
    path = tmp_path / "bad.pt"
    torch.save(payload, path)
    with pytest.raises(StoreFormatError, match=message) as caught:
        read_lens(path)
    assert "\n" not in str(caught.value)


def test_a_file_that_is_not_a_torch_file_is_refused(tmp_path) -> None:
    path = tmp_path / "notes.pt"
    path.write_text("a lens, honest\n")
    with pytest.raises(StoreFormatError, match="Expected a lens artifact readable by torch.load"):
        read_lens(path)


def test_an_artifact_is_read_like_a_lens_folder_and_checked_against_the_model(tmp_path) -> None:
    """The same lens as a folder and as a float32 artifact reads a prompt the same on the default model (the
    readings go through the final norm); a lens of another width or with a layer beyond the model is refused."""
    from detjac.engine import load_engine
    from detjac.runs import LENS_LOAD, check_lens_model, score_prompt, unembedding

    lens = _lens()
    folder = save_lens(lens, tmp_path / "texts.jlens")
    artifact = export_lens(lens, tmp_path / "texts.pt", dtype="float32")
    lenses = {"folder": read_lens(folder), "file": read_lens(artifact)}
    engine = check_lens_model(load_engine("default", **LENS_LOAD), list(lenses.values()))
    _, rows = score_prompt(engine, lenses, "Oak, n. A tree of the genus", unembedding(engine), [0, 2], exact=False)
    by = {(r["layer"], r["method"]): r for r in rows}
    for layer in (0, 2):
        assert by[layer, "folder"]["top"] == by[layer, "file"]["top"]
        assert abs(by[layer, "folder"]["error"] - by[layer, "file"]["error"]) < 1e-5
        assert by[layer, "folder"]["error"] != by[layer, "logit"]["error"]
    with pytest.raises(InvalidArgumentError, match="Expected a lens fitted on default \\(d_model 256, 4 layers"):
        check_lens_model(engine, [artifact_lens(export_lens(_lens(d=64), tmp_path / "narrow.pt"))])
    torch.save({"J": {5: torch.eye(D)}, "n_prompts": 1, "d_model": D, "source_layers": [5]}, tmp_path / "deep.pt")
    with pytest.raises(InvalidArgumentError, match="layers \\[5\\]"):
        check_lens_model(engine, [read_lens(tmp_path / "deep.pt")])


def test_a_published_lens_of_ordinary_jacobians_is_applied_and_evaluated(tmp_path) -> None:
    """A reference artifact (no detjac metadata: a lens of ordinary Jacobians) is read by `lens apply` and
    `lens evaluate` under its own kind; `--ordinary` beside it is refused by name."""
    lens = _lens()
    path = tmp_path / "published.pt"
    torch.save({"J": {layer: torch.from_numpy(lens.operator(layer)).half() for layer in (0, 1, 2)}, "n_prompts": 9,
                "source_layers": [0, 1, 2], "d_model": D}, path)
    applied = CliRunner().invoke(main, ["lens", "apply", str(path), "--prompt", "Oak, n. A tree of", "--no-exact"])
    assert applied.exit_code == 0, applied.output
    assert applied.output.count("ordinary lens") == 3 and "detached lens" not in applied.output
    prompts = tmp_path / "held.txt"
    prompts.write_text("Oak, n. A tree of the genus\nWhale, n. A\n")
    evaluated = CliRunner().invoke(main, ["lens", "evaluate", str(path), "--prompts", str(prompts), "--exact", "0"])
    assert evaluated.exit_code == 0, evaluated.output
    assert "ordinary lens" in evaluated.output
    both = CliRunner().invoke(main, ["lens", "apply", str(path), "--ordinary", str(path), "--prompt", "Oak"])
    assert both.exit_code == 2 and "Expected --ordinary beside a lens of detached Jacobians" in both.output


def test_export_of_a_same_position_lens_takes_the_gain_from_the_model(tmp_path) -> None:
    from detjac.engine import load_engine
    from detjac.engine.checkpoints.reference import resolve_model

    saved = save_lens(_lens(target="to_output", layers=(0, 3)), tmp_path / "same.lens")
    out = tmp_path / "same.pt"
    refused = CliRunner().invoke(main, ["lens", "export", str(saved), str(out)])
    assert refused.exit_code == 1 and "final norm gain" in refused.output and "--model" in refused.output
    done = CliRunner().invoke(main, ["lens", "export", str(saved), str(out), "--model", "default", "--dtype",
                                     "float32"])
    assert done.exit_code == 0, done.output
    gain = load_engine(resolve_model("default"), streamed=True, dtype=torch.float64).decoding_matrices(
        torch.float64)["final_norm"].numpy()
    payload = torch.load(out, weights_only=True)
    assert payload["source_layers"] == [0]  # layer 3, the model's last, left out
    want = _lens(target="to_output", layers=(0, 3)).operator(0) / gain[:, None]
    assert np.abs(payload["J"][0].double().numpy() - want).max() <= 1e-6 * np.abs(want).max()
    assert payload["metadata"]["detjac"]["converted"].startswith("rows divided by the final norm's gain")


def test_export_never_writes_through_a_link_planted_at_a_temporary_name(tmp_path) -> None:
    import os

    victim = tmp_path / "precious.txt"
    victim.write_text("precious")
    out = tmp_path / "l.pt"
    for planted in (f".l.pt.{os.getpid()}.tmp", f".l.pt.tmp-{os.getpid()}"):
        (tmp_path / planted).symlink_to(victim)
    export_lens(_lens(), out)
    assert victim.read_text() == "precious" and not out.is_symlink()
    assert read_lens(out).layers.tolist() == [0, 1, 2]


def test_a_hub_lens_never_leaves_the_cache(tmp_path, monkeypatch) -> None:
    data = export_lens(_lens(), tmp_path / "x.pt", dtype="float32").read_bytes()
    cache = tmp_path / "hub"
    snapshot = fabricate_hub_cache(cache, "someorg/lens", tmp_path, files={"lens.pt": data})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "lens.pt").write_bytes(data)  # what an escape would read
    with pytest.raises(InvalidArgumentError, match=r"Expected a revision of someorg/lens .* Got '(\.\./){3}outside'"):
        read_lens("someorg/lens@../../../outside:lens.pt")
    refs = cache / "models--someorg--lens" / "refs"
    (refs / "evil").write_text("../../../outside")
    with pytest.raises(CheckpointError, match=r"Expected a commit hash \(40 hexadecimal digits\) in .*evil\. Got "
                                              r"'\.\./\.\./\.\./outside'"):
        read_lens("someorg/lens@evil:lens.pt")
    (snapshot / "linked.pt").symlink_to(outside / "lens.pt")  # the variant: a snapshot entry linking out
    with pytest.raises(CheckpointError, match="inside its folder of the Hugging Face cache .* Got a link to"):
        read_lens("someorg/lens:linked.pt")
    assert read_lens(f"someorg/lens@{snapshot.name}:lens.pt").layers.tolist() == [0, 1, 2]  # a commit still works
