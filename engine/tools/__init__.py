"""Applications on one prompt's Jacobian: decoded singular triplets (``detjac jacobian``), the exactness report
(``detjac demo``), steering with a concept prompt (``detjac steer``) and exact attribution graphs (``detjac graph``)."""
