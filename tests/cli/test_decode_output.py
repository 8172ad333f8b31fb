"""``detjac analyze decode``'s table and figure as data and pictures: token lists, not display strings; a figure
whose columns hold their text; tokens no font has drawn without a warning (emoji, CJK)."""

from __future__ import annotations

import csv
import dataclasses
import json

import pyarrow.parquet as pq
from click.testing import CliRunner

from detjac.cli.main import main
from detjac.store.testing import WORDS, make_store, synthetic_model

# Every word past the prompts' own: an emoji, CJK, or text with a space, a quote and a comma.
ODD = tuple(("😀{}", "猫{}", 'say, "{}"')[i % 3].format(i) for i in range(40 - len(WORDS) - 1))


def odd_store(path):
    model = synthetic_model(d_model=6)
    return make_store(path, prompts=2, d_model=6, model=dataclasses.replace(model, words=(*model.words[:-len(ODD)],
                                                                                         *ODD)))


def test_decode_table_holds_token_lists_and_the_position_as_data(tmp_path):
    store = odd_store(tmp_path / "s.zarr")
    words = store.model.words
    for name in ("d.parquet", "d.csv"):
        out = CliRunner().invoke(main, ["analyze", "decode", str(store.path), "--k", "2", "--top", "40",
                                        "--table", str(tmp_path / name)])
        assert out.exit_code == 0, out.output
        if name.endswith(".parquet"):
            rows = pq.read_table(tmp_path / name).to_pylist()
        else:
            with open(tmp_path / name, newline="") as handle:
                rows = [{k: json.loads(v) if k.endswith(("_tokens", "_ids")) else v for k, v in r.items()}
                        for r in csv.DictReader(handle)]
        assert len(rows) == 2 * 2
        for row in rows:  # every token: its text, unquoted, at its id (the vocabulary is 40 words)
            assert row["left_tokens"] == [words[i] for i in row["left_ids"]] and len(row["left_ids"]) == 40
            assert row["right_tokens"] == [words[i] for i in row["right_ids"]]
            assert 0 <= int(row["right_position"]) < 4 and 0 < float(row["right_share"]) <= 1 + 1e-9
        assert ODD[11] == 'say, "11"' and ODD[11] in rows[0]["left_tokens"]  # a space, a quote, a comma: one token


def test_decoded_figure_holds_every_cell_inside_its_column_and_the_page(tmp_path, monkeypatch):
    from detjac.analysis import plots

    store = odd_store(tmp_path / "s.zarr")
    checked = []
    real_save = plots.save_figure

    def check_then_save(fig, path):
        from matplotlib.table import Table

        fig.canvas.draw()
        renderer, page = fig.canvas.get_renderer(), fig.bbox
        for table in fig.findobj(Table):
            for cell in table.get_celld().values():
                box, text = cell.get_window_extent(renderer), cell.get_text().get_window_extent(renderer)
                assert box.x0 <= text.x0 and text.x1 <= box.x1 + 0.5, cell.get_text().get_text()
                assert 0 <= box.x0 and box.x1 <= page.x1 + 0.5, (box, page, fig.get_figwidth())
                checked.append(cell)
        return real_save(fig, path)

    monkeypatch.setattr(plots, "save_figure", check_then_save)
    out = CliRunner().invoke(main, ["analyze", "decode", str(store.path), "--k", "3", "--top", "30",
                                    "--plot", str(tmp_path / "d.png")])
    assert out.exit_code == 0, out.output
    assert len(checked) == 2 * 4 * 4 and (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"


def test_decode_figure_of_emoji_and_cjk_tokens_warns_of_no_missing_glyph(tmp_path, recwarn):
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font

    from detjac.analysis.glyphs import drawable, fallback_families

    store = odd_store(tmp_path / "s.zarr")
    out = CliRunner().invoke(main, ["analyze", "decode", str(store.path), "--k", "2", "--top", "40",
                                    "--plot", str(tmp_path / "d.png")])
    assert out.exit_code == 0 and (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG", out.output
    assert not [str(w.message) for w in recwarn if "missing from font" in str(w.message)]
    covered = set()  # independently: the characters the fonts matplotlib finds have
    for family in ("sans-serif", *fallback_families()):
        covered |= set(FT2Font(font_manager.findfont(font_manager.FontProperties(family=[family]))).get_charmap())
    for text in ("😀12", "猫1", "crab 🦀", "\x12", 'say, "11"'):
        shown = drawable(text)
        assert all(ord(c) in covered for c in shown), shown
        for c in text:  # each character drawn as itself where a font has it, else as its escape
            assert (c in shown) if ord(c) in covered else (ascii(c)[1:-1] in shown), (c, shown)
    assert drawable("\x12") == "\\x12" and drawable("ok") == "ok"
