"""shardbench: distributed training strategies run side by side, measured the same way,
checked against a single-process reference."""
