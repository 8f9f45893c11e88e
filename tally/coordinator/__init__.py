"""The coordinator service: owns jobs and rounds, applies the algorithm's server half to sums
of cohort sums, and checkpoints every committed model (DESIGN.md section 2)."""
