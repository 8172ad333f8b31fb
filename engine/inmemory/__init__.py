"""The in-memory engine: a whole loaded model, its Jacobian in row blocks through ``torch.func`` or the explicit
pieces (:mod:`detjac.engine.pieces`)."""
