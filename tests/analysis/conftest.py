"""The analysis tests need neither torch nor a model: their stores come from ``detjac.store.testing``.

Nothing here (or in the tests of this folder) imports torch, ``detjac.engine`` or
``tiny_models``; ``tests/test_layering.py`` checks it.
"""
