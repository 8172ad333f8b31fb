"""Detaching: a loaded model's nonlinear factors (norm scales, attention probabilities, gates, activation ratios)
frozen at the prompt's values, so that its forward pass is linear in the input embeddings, and the check that the
path from input to output is then linear. The idea and its proof: docs/engine.md, "Detaching"."""
