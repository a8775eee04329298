"""Speculation measured, not assumed: the static drafter check, the model fingerprints, the
probe of the job's own rows, acceptance figures and the acceptance guard."""
