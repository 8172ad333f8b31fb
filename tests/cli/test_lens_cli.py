"""``detjac lens fit`` on synthetic stores: the fit, and a store without to_output targets refused by name."""

from __future__ import annotations

from click.testing import CliRunner

from detjac.cli.main import main
from detjac.store.testing import make_store


def test_fit_writes_the_lens_and_a_store_without_to_output_names_the_run_options(tmp_path):
    good = make_store(tmp_path / "s.zarr", prompts=3, d_model=4, n_layers=2, targets=("to_output.1",))
    out = CliRunner().invoke(main, ["lens", "fit", str(good.path), "--chunk", "2"])
    assert out.exit_code == 0, out.output
    assert "detached lens of 3 prompts, layers 1: 2 tasks now" in out.output
    again = CliRunner().invoke(main, ["lens", "fit", str(good.path)])
    assert "0 tasks now, 3 prompt-layers from earlier partial sums" in again.output
    plain = make_store(tmp_path / "p.zarr", prompts=1, targets=("layer.0",))
    bad = CliRunner().invoke(main, ["lens", "fit", str(plain.path)])
    assert bad.exit_code != 0 and "--components to_output" in bad.output and "Traceback" not in bad.output
    assert CliRunner().invoke(main, ["lens", "--help"]).output.count("detjac lens") >= 4


def read_only(monkeypatch, folder):
    """Make every write under ``folder`` fail as on a read-only file system (EROFS): as root, chmod cannot."""
    import builtins
    import errno
    import io
    import os

    def under(*paths):
        return any(os.path.abspath(os.fspath(p)).startswith(str(folder))
                   for p in paths if isinstance(p, str | os.PathLike))

    def refuse(path):
        raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))

    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    real_open, real_builtin_open = os.open, builtins.open
    monkeypatch.setattr(os, "open", lambda p, flags, *a, **k: refuse(p) if flags & writes and under(p)
                        else real_open(p, flags, *a, **k))

    def opener(p, mode="r", *a, **k):
        return refuse(p) if set(mode) & set("wax+") and under(p) else real_builtin_open(p, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", opener)
    monkeypatch.setattr(io, "open", opener)
    for name in ("mkdir", "rename", "replace", "unlink", "rmdir"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _real=real, **k: refuse(a[0]) if under(*a[:2]) else _real(*a, **k))


def test_fit_on_a_read_only_store_says_so_in_one_line(tmp_path, monkeypatch):
    store = make_store(tmp_path / "s.zarr", prompts=3, d_model=4, n_layers=2, targets=("to_output.1",))
    assert CliRunner().invoke(main, ["lens", "fit", str(store.path)]).exit_code == 0
    for folder in (store.path / "lens", store.path):  # only the lens folder (the lock is taken), then all of it
        with monkeypatch.context() as patch:
            read_only(patch, folder)
            out = CliRunner().invoke(main, ["lens", "fit", str(store.path)])
        assert out.exit_code == 1 and isinstance(out.exception, SystemExit), out.exception  # not a traceback
        assert out.output.count("\n") == 1 and "the file system is read-only" in out.output, out.output
        assert out.output.startswith(f"Error: Could not {'write lens/fitted' if folder.name == 'lens' else 'take'}")



def test_layers_read_the_same_by_lens_fit_and_run(tmp_path):
    """``--layers`` has one parser: ``All`` (any case) is every layer for ``lens fit`` as for ``run``'s targets, and
    what it refuses it refuses in the same words."""
    from detjac.targets import layer_targets

    assert [t.layer for t in layer_targets(" All ", "layer", 3)] == [0, 1, 2]
    store = make_store(tmp_path / "s.zarr", prompts=2, d_model=4, n_layers=2, targets=("to_output.1",))
    fitted = CliRunner().invoke(main, ["lens", "fit", str(store.path), "--layers", "All"])
    assert fitted.exit_code == 0 and "layers 1:" in fitted.output, fitted.output
    refused = CliRunner().invoke(main, ["lens", "fit", str(store.path), "--layers", "1,x"])
    assert refused.exit_code == 2
    assert "Expected --layers 'all' or comma-separated layer indices (e.g. 0,5,10). Got '1,x'." in refused.output
