"""The coordinator service: owns jobs and rounds, applies the algorithm's server half to sums
of cohort sums, and checkpoints every committed model (DESIGN.md section 2).

Its rooms, lowest first (a room imports its own or a lower one; ``pyproject.toml`` holds the rule):
``metrics``; ``spec`` (job spec, catalogue); ``state`` (store, database, codecs, enrolled devices,
leadership, events); ``rounds`` (runner, planner, sessions, holds, reports, pacing, checkpoints);
``faces`` (device API, admin API, device fronts, rate limits); then ``service`` and ``replica``,
which assemble a running coordinator."""
