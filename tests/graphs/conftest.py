"""Tiny random models of every family as fixtures (see ``tests/tiny_models.py``)."""

from tiny_models import family_model, llama_checkpoint, one_thread, prompt_ids, streamable_model  # noqa: F401
