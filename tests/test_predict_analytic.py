"""The analytic model reproduces the ZeRO paper's Table 1 (every entry)."""

import pytest

from harness.predict.analytic import FP32_ADAM, zero_comm_elements, zero_model_states

# Rajbhandari et al. 2020, Table 1: GB (1e9 bytes) of model states per device, K = 12,
# for N_d = 1, 4, 16, 64, 256, 1024. Copied as printed (../shared/reference/formulas.md).
DEGREES = (1, 4, 16, 64, 256, 1024)
TABLE_1 = {
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


def _printed_precision(entry: str) -> float:
    """One unit in the last printed digit: the paper rounds small values to 3 significant
    digits and cuts large ones to whole GB, so a correct formula lands within one unit."""
    return 10.0 ** -len(entry.split(".")[1]) if "." in entry else 1.0


@pytest.mark.parametrize("key", list(TABLE_1), ids=lambda k: f"{k[0]:.3g}-stage{k[1]}")
def test_zero_table_1(key):
    n_params, stage = key
    for degree, printed in zip(DEGREES, TABLE_1[key]):
        predicted_gb = zero_model_states(n_params, degree, stage).total / 1e9
        assert abs(predicted_gb - float(printed)) < _printed_precision(printed), (degree, printed, predicted_gb)


def test_breakdown_by_stage():
    psi, n = 1e9, 8
    base = zero_model_states(psi, n, 0)
    assert (base.params, base.grads, base.optimizer) == (2e9, 2e9, 12e9)
    assert zero_model_states(psi, n, 1).optimizer == 12e9 / n
    assert zero_model_states(psi, n, 2).grads == 2e9 / n
    assert zero_model_states(psi, n, 3).params == 2e9 / n
    fp32 = zero_model_states(psi, 1, 0, **FP32_ADAM)
    assert fp32.total == base.total == 16e9  # 16 bytes per parameter either way


def test_communication_volume():
    assert zero_comm_elements(1e9, 0) == zero_comm_elements(1e9, 2) == 2e9
    assert zero_comm_elements(1e9, 3) == 1.5 * zero_comm_elements(1e9, 0)


def test_bad_stage_or_world_size():
    with pytest.raises(ValueError, match="zero_stage=4: choose 0, 1, 2 or 3"):
        zero_model_states(1e9, 8, 4)
    with pytest.raises(ValueError, match="world_size=0"):
        zero_model_states(1e9, 0, 1)
