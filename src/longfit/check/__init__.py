"""`longfit check`: longfit's forward and backward on a shrunken copy of the run's own model against transformers'
eager attention, under the run's techniques (`longfit.check.parity.check_run`)."""
