"""Applications on one prompt's Jacobian: decoded singular triplets (``detjac jacobian``), the exactness report
(``detjac demo``) and steering with a concept prompt (``detjac steer``)."""
