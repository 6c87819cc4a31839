"""float8 e4m3 decoded from its bit layout, independently of torch and kvcompact: the oracle the fp8 KV-cache tests
(tests/unit/test_fp8_keys.py, tests/engine/test_fp8.py) check kvcompact's key reader against."""

from __future__ import annotations

import numpy as np


def decode_e4m3(raw: np.ndarray) -> np.ndarray:
    """float8 e4m3fn bytes -> float64, from the bit layout (1 sign, 4 exponent bits with bias 7, 3 mantissa
    bits; exponent 0 is subnormal; 0x7f/0xff are NaN)."""
    raw = raw.astype(np.int64)
    sign = np.where(raw & 0x80, -1.0, 1.0)
    exp = (raw >> 3) & 0xF
    man = raw & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7))
    return np.where((raw & 0x7F) == 0x7F, np.nan, sign * value)
