"""fedavgm: a Tally algorithm package (its entry point is ``tally_fedavgm.algorithm:ALGORITHM``)."""
