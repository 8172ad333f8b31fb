"""Token text a figure can draw: every character in a font matplotlib has, or written as its escape.

Decoded tokens hold emoji, CJK, control characters and the replacement character. matplotlib warns (a
``UserWarning`` naming its source file) for every glyph its font lacks and draws an empty box. Here each text
of a figure, table cells included, gets the installed fonts that cover more of Unicode as fallbacks
(:data:`FALLBACKS`, where installed), and a character none of them has is drawn as its Python escape
(``\\U0001f980``, ``\\x12``), as the CLI prints tokens. Nothing is guaranteed about fonts that are not installed.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

# Fonts with wide coverage, tried after the text's own font where installed (CJK, emoji outlines, symbols).
FALLBACKS = ("Noto Sans CJK JP", "Noto Sans CJK SC", "Noto Sans SC", "Noto Sans JP", "WenQuanYi Zen Hei",
             "WenQuanYi Micro Hei", "Droid Sans Fallback", "Source Han Sans", "Noto Emoji", "Symbola",
             "Noto Sans Symbols 2", "Noto Sans Symbols", "Unifont")


@lru_cache(maxsize=1)
def fallback_families() -> tuple[str, ...]:
    """The :data:`FALLBACKS` matplotlib finds on this machine."""
    from matplotlib import font_manager

    installed = {f.name for f in font_manager.fontManager.ttflist}
    return tuple(name for name in FALLBACKS if name in installed)


@lru_cache(maxsize=64)
def _charmap(path: str) -> frozenset[int]:
    from matplotlib.ft2font import FT2Font

    return frozenset(FT2Font(path).get_charmap())


def _covered(families: tuple[str, ...]) -> frozenset[int]:
    from matplotlib import font_manager

    codes: set[int] = set()
    for family in families:
        try:
            path = font_manager.findfont(font_manager.FontProperties(family=[family]), fallback_to_default=False)
        except ValueError:  # not installed: covers nothing
            continue
        codes |= _charmap(path)
    return frozenset(codes)


def drawable(text: str, families: tuple[str, ...] = ("sans-serif",)) -> str:
    """``text`` with every character that none of ``families`` and :func:`fallback_families` has as its escape.

    Parameters
    ----------
    text : str
        What a figure should show.
    families : tuple of str
        The text's own font families (matplotlib names or generic ``sans-serif``).

    Returns
    -------
    str
        ``text`` unchanged where every glyph is there; else e.g. ``'猫'`` -> ``'\\u732b'`` without a CJK font.
    """
    covered = _covered((*families, *fallback_families()))
    return "".join(c if ord(c) in covered or c in "\n" else ascii(c)[1:-1] for c in text)


def make_drawable(fig: Any) -> None:
    """Give every text of ``fig`` (titles, labels, legends, table cells) the fallback fonts and escape what no
    font has (see the module docstring), so drawing it warns of no missing glyph."""
    from matplotlib.table import Table
    from matplotlib.text import Text

    texts = list(fig.findobj(Text)) + [cell.get_text() for table in fig.findobj(Table)
                                        for cell in table.get_celld().values()]
    for text in texts:
        own = tuple(f for f in text.get_fontfamily() if f not in fallback_families())  # once, if called again
        text.set_fontfamily([*own, *fallback_families()])
        text.set_text(drawable(text.get_text(), own))
