"""One test per published claim (harness/claims/), each re-derived from its formula and,
where this host can run the cells it reads, measured; ``--suite claims`` runs them. The
verdicts land in results/<run_id>/claims.jsonl and the run's report; suites/claims/conftest.py
turns a verdict into the test's outcome."""

import pytest

from harness.claims import catalogue


@pytest.mark.claims
@pytest.mark.parametrize("claim_id", list(catalogue.CLAIMS))
def test_claim(claim_id, judge):
    judge(claim_id)
