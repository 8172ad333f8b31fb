"""Where a head's attention file lives beside its graph: ``STEM.qk.L{layer}.H{head}.json`` beside ``STEM.json``, the
name ``detjac view STEM.json`` finds it by (``STEM.qk.*.json``), whoever writes it (``detjac attention``, its
``--graph``, ``detjac graph --attention-pages``) and whatever command a page suggests for it. Torch-free."""

from __future__ import annotations

__all__ = ["attention_file_name"]


def attention_file_name(stem: str, layer: int, head: int) -> str:
    """The file name of head ``head`` of layer ``layer``'s attention file beside the graph ``STEM.json``."""
    return f"{stem}.qk.L{layer}.H{head}.json"
