"""What a Jacobian is used for without storing it: products ``J v`` and ``Jᵀ u`` as an operator, its top singular
triplets by block Lanczos, logits, and singular vectors decoded to tokens."""
