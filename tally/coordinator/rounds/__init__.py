"""How a job's rounds run: the planner's decisions, the runner's I/O, the cohorts' secure-sum sessions
on the aggregators, check-in holds, step answers, task reports, pacing, checkpoints and exports."""
