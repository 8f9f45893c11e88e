"""The in-process simulator and the reports built on it: the research path of ``tally simulate``."""
