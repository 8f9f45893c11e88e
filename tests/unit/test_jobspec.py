"""Job-spec validation (issue 9, items 2 and 3): wrongly typed values are refused with the field
path and the type that was given, never a crash; every problem is reported in one error."""

from __future__ import annotations

import warnings

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tally.coordinator.spec import jobspec

BASE = {"name": "t", "algorithm": "fedavg", "rounds": 2, "cohort_size": 10, "min_cohort": 5}


def _errors(**overrides) -> list[str]:
    raw = {**BASE, **overrides}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(jobspec.JobSpecError) as err:
        jobspec.parse(yaml.safe_dump(raw))
    return str(err.value).splitlines()


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"secure": {"dropout_rate": "high"}}, "secure.dropout_rate: must be a number, got 'high' (str)"),
        ({"secure": {"dropout_rate": 0.9}}, "secure: malicious server requires corrupt_rate + 2*dropout_rate <= 0.9"),
        ({"secure": {"consistency_check": "yes"}}, "secure.consistency_check: must be true or false, got 'yes' (str)"),
        ({"reveal": "response"}, "reveal: must be a list, got 'response' (str)"),
        ({"options": {"local_epochs": "5"}}, "options.local_epochs: must be an integer, got '5' (str)"),
        ({"options": {"local_lr": [0.1]}}, "options.local_lr: must be a number, got [0.1] (list)"),
        ({"rounds": 2.5}, "rounds: must be an integer, got 2.5 (float)"),
        ({"model": {"hidden": "64"}}, "model.hidden: must be an integer, got '64' (str)"),
        ({"deadlines": {"unmask": "soon"}}, "deadlines.unmask: must be a number, got 'soon' (str)"),
        ({"secure": "on"}, "secure: must be a mapping, got 'on' (str)"),
    ],
)
def test_a_wrongly_typed_value_is_one_line_naming_the_field_and_its_type(overrides, needle):
    lines = _errors(**overrides)
    assert needle in lines or any(line.startswith(needle) for line in lines), lines


def test_a_string_reveal_is_one_error_not_one_per_letter():
    lines = _errors(algorithm="aaggff_s", options={"num_clients": 10}, reveal="response")
    assert sum("reveal" in line for line in lines) == 1, lines


def test_unknown_keys_list_the_valid_ones():
    (line,) = _errors(options={"local_epoch": 5, "lr": 1})
    assert line.startswith("options: unknown fedavg options ['local_epoch', 'lr']; its options: [")
    assert "'local_epochs'" in line and "'local_lr'" in line
    (line,) = _errors(secure={"dropout": 0.1})
    assert line.startswith("secure: unknown keys ['dropout']; valid keys: [") and "'dropout_rate'" in line
    (line,) = _errors(round=3)
    assert line.startswith("unknown keys ['round']; valid keys: [") and "'rounds'" in line
    (line,) = _errors(deadlines={"unmsk": 3})
    assert line.startswith("deadlines: unknown keys ['unmsk']") and "'unmask'" in line


def test_missing_required_fields_do_not_stop_the_checking():
    lines = _errors(name=None, cohort_size=None, rounds=0, secure={"dropout_rate": "high"},
                    options={"local_epochs": "5"}, model={"kind": "nope"})
    for needle in ("name: required", "cohort_size: required", "rounds: must be >= 1",
                   "secure.dropout_rate:", "options.local_epochs:", "model.kind: 'nope' is not one of"):
        assert any(line.startswith(needle) for line in lines), (needle, lines)


def test_typed_options_of_every_algorithm_refuse_a_string_for_a_number():
    from tally import algorithms

    for name in algorithms.NAMES:
        options = jobspec.option_fields(name)
        assert options, name
        key = next(k for k, kind in options.items() if kind is int)
        lines = _errors(algorithm=name, options={key: "5"})
        assert f"options.{key}: must be an integer, got '5' (str)" in lines, (name, lines)


def test_a_valid_spec_round_trips_through_yaml():
    spec = jobspec.parse(yaml.safe_dump({**BASE, "options": {"local_epochs": 2, "local_lr": 1},
                                         "secure": {"dropout_rate": 0.2}, "deadlines": {"unmask": 5}}))
    assert spec.options == {"local_epochs": 2, "local_lr": 1}
    assert spec.secure.dropout_rate == 0.2 and spec.deadlines["unmask"] == 5.0
    assert spec.deadlines["checkin"] == jobspec.DEFAULT_DEADLINES["checkin"]
    assert jobspec.parse(spec.to_yaml()) == spec


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
KEYS = st.sampled_from([*jobspec.JobSpec.model_fields, "secure", "model", "deadlines", "options", "config", "extra"])


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(KEYS, JSONISH, max_size=6), st.dictionaries(st.text(max_size=6), JSONISH, max_size=3))
def test_any_document_is_a_spec_or_a_job_spec_error(overrides, section):
    raw = {**BASE, **overrides}
    for key in ("secure", "model", "deadlines", "options", "config"):
        if key in overrides and isinstance(overrides[key], dict):
            raw[key] = {**section, **overrides[key]}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # `config:`, the old name, is drawn too
            jobspec.from_dict(raw)
    except jobspec.JobSpecError as exc:
        assert str(exc).strip()


def test_options_that_do_not_fit_the_model_are_refused_before_the_job_starts():
    """LG-FedAvg's default global patterns name the mlp's head ('2.*'): on the cnn they match
    nothing, which used to pass validation and fail only when the job started."""
    lines = _errors(algorithm="lg_fedavg", model={"kind": "cnn", "hidden": 8})
    assert any(line.startswith("model: the cnn model does not fit lg_fedavg's options: global_patterns "
                               "['2.*'] match none") for line in lines), lines
    fitting = {**BASE, "algorithm": "lg_fedavg", "model": {"kind": "cnn", "hidden": 8},
               "options": {"global_patterns": ["head.*"]}}
    assert jobspec.parse(yaml.safe_dump(fitting)).algorithm == "lg_fedavg"


def test_the_consistency_check_is_on_by_default_and_off_only_for_a_semi_honest_server():
    """Third security review, finding 1: a job that turns the check off while assuming a malicious
    server is refused; a default job runs it; a plain (benchmark) sum has no survivors to check."""
    assert jobspec.parse(yaml.safe_dump(BASE)).secure.checks_consistency
    (line,) = _errors(secure={"consistency_check": False})
    assert line.startswith("secure.consistency_check: false leaves a malicious server free")
    semi = jobspec.parse(yaml.safe_dump({**BASE, "secure": {"malicious_server": False, "consistency_check": False}}))
    assert not semi.secure.checks_consistency
    assert not jobspec.parse(yaml.safe_dump({**BASE, "secure": {"plain": True}})).secure.checks_consistency


def test_every_algorithm_option_has_a_meaning_and_the_table_has_no_stale_entry():
    import dataclasses

    from tally import algorithms
    from tally.algorithms.options import OPTIONS

    used = {f.name for name in algorithms.NAMES for f in dataclasses.fields(algorithms.options_type(name))
            if f.init and f.name != "reveal"}
    assert used == set(OPTIONS), (used - set(OPTIONS), set(OPTIONS) - used)
    assert all(option.meaning for option in OPTIONS.values())


def test_option_ranges_are_checked_at_validation_each_naming_its_option():
    """Issue 25, item 3: these were "valid", and every device then failed the round
    (`ValueError: Invalid learning rate: -0.1`); `example_cap: -5` was blamed on a codec field."""
    text = ("name: x\nalgorithm: fedavg\nrounds: 2\ncohort_size: 10\n"
            "options: {local_epochs: -2, local_lr: -0.1, batch_size: 0, server_lr: 0, example_cap: -5}\n")
    with pytest.raises(jobspec.JobSpecError) as err:
        jobspec.parse(text)
    assert str(err.value).splitlines() == [
        "options.local_epochs: must be >= 1, got -2", "options.local_lr: must be > 0, got -0.1",
        "options.batch_size: must be >= 1, got 0", "options.server_lr: must be > 0, got 0",
        "options.example_cap: must be >= 1, got -5"]


def test_the_old_name_config_is_read_as_options_with_a_warning_naming_it():
    """Issue 43: ``options:`` was ``config:``; a spec written with the old name still runs for one
    release, and says so, to the Python caller and to whoever validates or submits it."""
    renamed: list[str] = []
    with pytest.warns(DeprecationWarning, match="config: deprecated, renamed options:"):
        spec = jobspec.parse(yaml.safe_dump({**BASE, "config": {"local_epochs": 2}}), renamed)
    assert spec.options == {"local_epochs": 2}
    assert renamed == ["config: deprecated, renamed options: (read as options: until the next release)"]
    with pytest.warns(DeprecationWarning), pytest.raises(jobspec.JobSpecError, match=r"options\.local_epochs: must"):
        jobspec.from_dict({**BASE, "config": {"local_epochs": "5"}})  # checked under its new name


def test_options_and_config_together_are_refused_naming_both():
    lines = _errors(options={"local_epochs": 2}, config={"local_epochs": 3})
    assert lines == ["options: given twice, as options: and as its deprecated name config:; keep options: only"]


def test_a_min_cohort_too_small_for_the_secure_settings_names_the_smallest_that_is():
    """Issue 39, item 9: the error suggests the value to write, and that value parses."""
    secure = {"dropout_rate": 0.1, "corrupt_rate": 0.05}
    (line,) = [e for e in _errors(min_cohort=4, secure=secure) if e.startswith("min_cohort")]
    assert line.endswith("the smallest that is: min_cohort: 5"), line
    jobspec.parse(yaml.safe_dump({**BASE, "min_cohort": 5, "secure": secure}))
