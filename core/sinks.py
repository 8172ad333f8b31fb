"""Attention sinks, named where a right singular vector is decoded (torch-free; the one rule every print site calls).

A right singular vector ``v`` of the combined operator ``[J_1 … J_n]`` has one block per input position, and the
decoders report the position whose block holds the largest share of ``|v|²`` (``right [at 'The', 97% of |v|^2]``).
When at least :data:`SINK_SHARE` of it sits on position 0, the vector is mostly about the first token, which in
trained models is usually an *attention sink*: a position many heads attend to by default, whose very large
activations dominate norms without carrying the prompt's meaning. Such a vector's decoded tokens say little about
the prompt, and a reader should be told so rather than left to read `' implement' ' attendance'` as a finding.

The rule is a flag, not a test of the heads: it looks at where the vector's weight sits, nothing else. A per-token
operator ``J_k`` has one block (its share is 1 by construction), so it is never flagged.
"""

from __future__ import annotations

SINK_SHARE = 0.9  # the share of |v|^2 on position 0 from which a right vector is flagged
SINK_NOTE = "the first token: likely an attention sink"


def sink_note(position: int, share: float, combined: bool = True) -> str | None:
    """The flag of a decoded right singular vector, or None.

    Parameters
    ----------
    position : int
        The input position whose block holds the largest share of ``|v|²`` (0: the first token).
    share : float
        That block's share of ``|v|²``, in [0, 1].
    combined : bool
        Whether ``v`` is a right vector of the combined operator ``[J_1 … J_n]`` (one block per position); a
        per-token operator's vector has one block and is never flagged.

    Returns
    -------
    str or None
        :data:`SINK_NOTE` when ``combined`` and at least :data:`SINK_SHARE` of ``|v|²`` sits on position 0.
    """
    return SINK_NOTE if combined and int(position) == 0 and float(share) >= SINK_SHARE else None
