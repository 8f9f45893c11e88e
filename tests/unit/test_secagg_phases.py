"""The phase table agrees with the protocol that runs, the wire that carries its deadlines and
the job spec that sets them; and its members are the plain strings labels and logs always used."""

from __future__ import annotations

import numpy as np
import pytest

from support.secagg import lax_cohort, make_config, random_inputs
from tally.coordinator.spec.jobspec import DEFAULT_DEADLINES
from tally.secagg import Dropout
from tally.secagg.messages import (
    Abort,
    ConsistencyCheckRequest,
    MaskedInputRequest,
    SessionRef,
    ShareKeysRequest,
    UnmaskRequest,
)
from tally.secagg.phases import DEADLINED, DROPPABLE, TIMED, Phase, asked_for
from tally.wire.v1 import secagg_pb2

REF = SessionRef("job", 1, "sess")


@pytest.mark.parametrize(("message", "expected"), [
    (ShareKeysRequest(REF, ()), (Phase.SHARE_KEYS, "")),
    (MaskedInputRequest(REF, "b"), (Phase.MASKED_INPUT, "b")),
    (ConsistencyCheckRequest(REF, "b", (1, 2)), (Phase.CONSISTENCY_CHECK, "b")),
    (UnmaskRequest(REF, "b", (1,)), (Phase.UNMASK, "b")),
    (Abort(REF, "over"), None),
])
def test_each_request_asks_for_its_phase_of_its_sum(message, expected):
    assert asked_for(message) == expected


def test_every_phase_with_a_deadline_has_its_wire_field_and_spec_default():
    fields = set(secagg_pb2.PhaseDeadlines.DESCRIPTOR.fields_by_name)
    assert {p.deadline_field for p in DEADLINED} == fields
    assert set(DEADLINED) <= DEFAULT_DEADLINES.keys()
    with pytest.raises(ValueError, match="share_complaints"):
        _ = Phase.SHARE_COMPLAINTS.deadline_field


def test_every_phase_a_session_passes_through_is_timed_under_its_table_name():
    config = make_config(8, 7, 4, sums=(("a", 3, 20), ("b", 3, 20)), consistency=True)
    dropouts = {2: Dropout(Phase.MASKED_INPUT, "b"), 5: Dropout(Phase.UNMASK, "a")}
    run = lax_cohort(config, random_inputs(config, np.random.default_rng(0)), dropouts)
    assert run.aborted is None
    assert set(run.server_seconds) | set(run.client_seconds) <= set(TIMED) | {Phase.JOIN}
    assert set(DROPPABLE) <= set(run.server_seconds)


def test_members_read_as_their_plain_names():
    assert [f"{p}" for p in DROPPABLE] == [str(p) for p in DROPPABLE] == [
        "advertise_keys", "share_keys", "masked_input", "consistency_check", "unmask"]
    assert repr(DROPPABLE) == repr(tuple(p.value for p in DROPPABLE))
    assert Phase.JOIN.deadline is Phase.ADVERTISE_KEYS and Phase.JUSTIFY.deadline is Phase.SHARE_KEYS
