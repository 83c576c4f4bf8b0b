"""Published claims, re-derived from the papers' formulas (harness/predict/analytic.py) and,
where this host can run the cells, measured (suites/claims/, ``--suite claims``; README
"Claims"). Each claim reads the cells it names and gives one claim record, which the run's
report renders.

- base: what a claim is (``Claim``), what its judge reads and gives (``Readings``,
  ``Outcome``, ``NotMeasurable``), the claims cell and the tolerances;
- judges: one judge per claim;
- zero_claims: the model-state and communication claims made of each strategy;
- published: the papers' tables as printed;
- catalogue: every claim (``CLAIMS``), the written-down deviations, the cells they read;
- records: the claim record, made, appended to claims.jsonl, read back and formatted.
"""
