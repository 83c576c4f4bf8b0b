"""The papers' tables as printed, kept once: the claims check them against the formulas and
torch, and tests/test_predict_analytic.py checks the formulas against them."""

from __future__ import annotations

# formulas.md "Precision": max, smallest normal, smallest subnormal, eps (3 significant digits).
PRECISION_TABLE = {
    "fp16": {"max": 65504, "smallest_normal": 6.10e-5, "smallest_subnormal": 5.96e-8, "eps": 9.77e-4},
    "bf16": {"max": 3.39e38, "smallest_normal": 1.18e-38, "smallest_subnormal": 9.18e-41, "eps": 7.81e-3},
}

TABLE_1_DEGREES = (1, 4, 16, 64, 256, 1024)
TABLE_1 = {  # Rajbhandari et al. 2020, Table 1: GB per device, K = 12, as printed
    (7.5e9, 1): ("120", "52.5", "35.6", "31.4", "30.4", "30.1"),
    (7.5e9, 2): ("120", "41.3", "21.6", "16.6", "15.4", "15.1"),
    (7.5e9, 3): ("120", "30", "7.5", "1.88", "0.47", "0.12"),
    (128e9, 1): ("2048", "896", "608", "536", "518", "513"),
    (128e9, 2): ("2048", "704", "368", "284", "263", "257"),
    (128e9, 3): ("2048", "512", "128", "32", "8", "2"),
    (1e12, 1): ("16000", "7000", "4750", "4187", "4046", "4011"),
    (1e12, 2): ("16000", "5500", "2875", "2218", "2054", "2013"),
    (1e12, 3): ("16000", "4000", "1000", "250", "62.5", "15.6"),
}

