"""Values as JSON can hold them: numpy scalars and arrays as numbers and lists, non-finite floats as null."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np


def finite_number(value: Any) -> bool:
    """Whether ``value`` read from a JSON file is a finite number (a bool is not; NaN and infinities are not)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def jsonable(value: Any) -> Any:
    """``value`` with numpy types, tuples and non-finite floats (JSON has no NaN) made JSON-safe, recursively."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, bool | int | str):
        return value
    return str(value)
