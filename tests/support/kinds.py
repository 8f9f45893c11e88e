"""Which kind of test each test module holds, so that ``pytest -m unit`` runs the fast ones alone.

- ``unit``: in this process, no server and no port: a module, a function, a fake.
- ``service``: real servers on 127.0.0.1 or child processes, short of the whole system: one role
  over gRPC against fakes or scripted peers, a command line, a build, rendered manifests.
- ``e2e``: the whole system: a real coordinator, real aggregators and devices (SDK fleets,
  processes, pods or containers) running jobs.

A module's kind is that of its heaviest test. ``tests/conftest.py`` marks every test with its
module's kind, and ``tests/test_suite_layout.py`` fails on a module missing from this table, so a
new module is classified when it is added. The ``full`` and ``containers`` markers are orthogonal
(``pytest -m "unit and not full"``).
"""

from __future__ import annotations

UNIT, SERVICE, E2E = "unit", "service", "e2e"

KINDS: dict[str, str] = {
    "test_aaggff": UNIT,
    "test_adaptation": UNIT,
    "test_adaptation_job": E2E,
    "test_aggregator": SERVICE,
    "test_aggregator_attacks": SERVICE,
    "test_agnostic_fedavg": UNIT,
    "test_algorithm_contract": UNIT,
    "test_bench_fleet_smoke": E2E,
    "test_bench_round_smoke": E2E,
    "test_bench_smoke": SERVICE,
    "test_chaos": E2E,
    "test_cli_demo": E2E,
    "test_cli_errors": SERVICE,
    "test_cli_jobs": E2E,
    "test_cli_logs": SERVICE,
    "test_cli_readme": UNIT,
    "test_cli_report": UNIT,
    "test_client_progress": E2E,
    "test_client_sdk": SERVICE,
    "test_codec": UNIT,
    "test_containers": E2E,
    "test_coordinator_service": SERVICE,
    "test_coordinator_unit": UNIT,
    "test_device_fronts": E2E,
    "test_docs_site": SERVICE,
    "test_embedding_guide": E2E,
    "test_enrolment": SERVICE,
    "test_feddar": UNIT,
    "test_fedevg": UNIT,
    "test_fleet_audit": E2E,
    "test_fleet_behaviour": E2E,
    "test_fleet_processes": SERVICE,
    "test_fleet_refusals": E2E,
    "test_full_stack": E2E,
    "test_full_stack_algorithms": E2E,
    "test_full_stack_fedevg": E2E,
    "test_full_stack_personal": E2E,
    "test_jobspec": UNIT,
    "test_k8s": SERVICE,
    "test_k8s_ops": SERVICE,
    "test_layers": UNIT,
    "test_lg_fedavg": UNIT,
    "test_local_adaptation_oracles": UNIT,
    "test_metrics_catalogue": SERVICE,
    "test_models": UNIT,
    "test_monitoring": E2E,
    "test_pacing": SERVICE,
    "test_packaging": SERVICE,
    "test_privacy": UNIT,
    "test_privacy_algorithms": UNIT,
    "test_privacy_bench_smoke": E2E,
    "test_privacy_full_stack": E2E,
    "test_replicas": E2E,
    "test_resume": E2E,
    "test_sdk_example": E2E,
    "test_secagg_attacks": UNIT,
    "test_secagg_dealers": UNIT,
    "test_secagg_errors": UNIT,
    "test_secagg_large": UNIT,
    "test_secagg_params": UNIT,
    "test_secagg_privacy": UNIT,
    "test_secagg_protocol": UNIT,
    "test_security": SERVICE,
    "test_shamir": UNIT,
    "test_simulation": UNIT,
    "test_split_view_services": E2E,
    "test_state_codec": UNIT,
    "test_suite_layout": UNIT,
    "test_superfed": UNIT,
    "test_sybils": SERVICE,
    "test_timeline": UNIT,
    "test_tls_failures": SERVICE,
    "test_undecodable_requests": E2E,
    "test_wire": UNIT,
}
