"""FedEvg through the real services (issue 13): coordinator, two aggregators and a fleet of energy
trainers with masking on give the in-process run's synthetic set within quantisation; the
energy models never leave the devices (only the two energy-signal sums are summed)."""

from __future__ import annotations

import numpy as np

from support.devices import FEDEVG_TOY, fedevg_toy_devices
from support.jobs import reference_halves, run_job
from tally import algorithms
from tally.algorithms.fedevg import SYNTHETIC_X, FedEvgOptions
from tally.models.params import get_params
from tally.sim.rounds import plain_sum, run_rounds

ROUNDS = 3


def test_fedevg_through_the_services_equals_the_in_process_result(tmp_path):
    options = {**FEDEVG_TOY, "local_iterations": 5, "schedule_rounds": ROUNDS, "input_range": [-3.0, 3.0]}
    _, factory, devices = fedevg_toy_devices(seed=2)
    state, _ = run_job(tmp_path, "fedevg", options, "fedevg-toy", get_params(factory()), devices, ROUNDS)
    _, factory, reference_devices = fedevg_toy_devices(seed=2)
    server, client = reference_halves("fedevg", options, get_params(factory()))
    reference, _ = run_rounds(server, client, reference_devices, get_params(factory()), ROUNDS,
                              len(reference_devices), plain_sum)
    (step,) = server.steps(reference)
    assert {f.name for f in step.schema.fields if not f.name.startswith("metric.")} == {"weighted_gradient", "weight"}
    start = algorithms.make("fedevg", options)[0].init({}).synthetic[SYNTHETIC_X]
    got, want = state.synthetic[SYNTHETIC_X], reference.synthetic[SYNTHETIC_X]
    assert np.max(np.abs(got - want)) < 1e-3 < np.max(np.abs(want - start))
    assert FedEvgOptions.from_dict(options).input_range == (-3.0, 3.0)
