"""A detached decoder layer as explicit linear pieces (plain matmuls of recorded factors), and the layer runner
both engines share: the explicit sweeps of the in-memory and the streamed engine go through here."""


class NotAPiece(Exception):
    """A layer, norm or module that is not made of known pieces; its message says why.

    Internal: the builders here raise it, and the two fallback points (the in-memory engine's rows,
    :mod:`detjac.engine.inmemory.rows`, around :func:`~detjac.engine.inmemory.model_pieces.freeze_model`; the streamed
    engine's :class:`~detjac.engine.streamed.adjoint.ExplicitAdjoint`) catch it and go through ``torch.func`` instead,
    warning with the reason. It never reaches a user."""
