"""Generates dashboard.json, the Tally Grafana dashboard, with Grafana Labs' grafana-foundation-sdk
(builders typed from Grafana's own dashboard schema, so a misspelt option fails here rather than
in Grafana).

    python k8s/monitoring/dashboard.py > k8s/monitoring/dashboard.json

tests/test_monitoring.py checks that dashboard.json is this script's output, and runs every query
in it against a real Prometheus that scraped a real job. Every query sums ``by (namespace)`` over
the namespaces of the Namespace variable (a second deployment in another namespace is shown
apart, not added in); the Job variable selects among the series that name a job (``job_id``). Besides those, queries
use only Grafana's built-in ``$__rate_interval`` and ``$__range``; series and units are in
docs/metrics.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, SortOrder, TooltipDisplayMode
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh, VariableSort
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

UID = "tally-overview"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "[$__rate_interval]"
# The Namespace variable's selection; without Kubernetes series have no namespace, which ".*"
# (the variable's "All") matches.
IN_NAMESPACE = 'namespace=~"$namespace"'
IN_JOB = 'job_id=~"$job_id"'
# Devices' task reports on tasks that did not complete (unmatched: not a task of the reporter's).
FAILED_REPORTS = 'outcome!~"completed|unmatched"'


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


def series(metric: str, matchers: str = "") -> str:
    """``metric`` in the selected namespaces, with ``matchers`` (PromQL label matchers) besides."""
    return f"{metric}{{{IN_NAMESPACE}{', ' + matchers if matchers else ''}}}"


def per_namespace(legend: str) -> str:
    """A legend that also names the namespace, for when the variable selects several."""
    return f"{legend} {{{{namespace}}}}" if legend else "{{namespace}}"


def p95(metric: str, by: str = "") -> Query:
    """The 95th percentile of a histogram, per ``by`` label when given."""
    labels = f"namespace, le, {by}" if by else "namespace, le"
    return Query(f"histogram_quantile(0.95, sum by ({labels}) (rate({series(metric + '_bucket')}{RATE})))",
                 per_namespace(f"p95 {{{{{by}}}}}" if by else "p95"))


def per_second(metric: str, by: str = "", legend: str = "", matchers: str = "") -> Query:
    grouping = f"namespace, {by}" if by else "namespace"
    return Query(f"sum by ({grouping}) (rate({series(metric, matchers)}{RATE}))",
                 per_namespace(legend or (f"{{{{{by}}}}}" if by else "")))


def summed(metric: str, matchers: str = "", by: str = "", how: str = "sum") -> Query:
    """A gauge or counter's value per namespace (and per ``by`` label), ``how`` aggregated."""
    grouping = f"namespace, {by}" if by else "namespace"
    return Query(f"{how} by ({grouping}) ({series(metric, matchers)})",
                 per_namespace(f"{{{{{by}}}}}" if by else ""))


def recorded(record: str, legend: str) -> Query:
    """A recording rule of rules.yaml (already per namespace) in the selected namespaces."""
    return Query(series(record), per_namespace(legend))


def variable(name: str, label: str, query: str) -> Builder:
    """A multi-value query variable with "All" (matching any value, and series without the label)."""
    return (dashboard.QueryVariable(name).label(label).query(query).datasource(DATASOURCE)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*"))


def _targets(panel: Builder, queries: list[Query], *, as_table: bool = False) -> Builder:
    for ref, query in zip("ABCDEFGH", queries):
        target = prometheus.Dataquery().expr(query.expr).legend_format(query.legend or "__auto").ref_id(ref)
        if as_table:  # the latest value per label set, one row each
            target = target.instant().format(PromQueryFormat.TABLE)
        panel = panel.with_target(target)
    return panel.datasource(DATASOURCE)


def graph(title: str, unit: str, queries: list[Query], description: str, width: int = 8) -> Builder:
    panel = (
        timeseries.Panel().title(title).description(description).unit(unit).min(0).span(width).height(8)
        .legend(common.VizLegendOptions().display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM)
                .show_legend(True))
        .tooltip(common.VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING))
    )
    return _targets(panel, queries)


def single(title: str, unit: str, query: Query, description: str) -> Builder:
    panel = (stat.Panel().title(title).description(description).unit(unit).span(4).height(4)
             .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))
    return _targets(panel, [query])


def listing(title: str, query: Query, description: str, width: int = 12) -> Builder:
    panel = table.Panel().title(title).description(description).span(width).height(8).show_header(True)
    return _targets(panel, [query], as_table=True)


def build() -> dict:
    board = (
        dashboard.Dashboard("Tally")
        .uid(UID)
        .description("Federated rounds, secure-aggregation phases, dropouts, traffic, sessions and alerts "
                     "(docs/metrics.md)")
        .tags(["tally", "federated-learning"])
        .refresh("30s")
        .time("now-6h", "now")
        .timezone("browser")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(variable("namespace", "Namespace", "label_values(tally_build_info, namespace)"))
        # Jobs named by any series (a running job's round, a job's privacy ledger, ...).
        .with_variable(variable("job_id", "Job",
                                f"label_values({{__name__=~\"tally_.+\", {IN_NAMESPACE}, job_id!=\"\"}}, job_id)"))
    )
    rows: list[tuple[str, list[Builder]]] = [
        ("Rounds", [
            single("Rounds committed", "none", summed("tally_coordinator_rounds_committed_total"),
                   "Rounds whose model was checkpointed since the coordinator started"),
            single("Running jobs", "none", summed("tally_coordinator_jobs", 'state="RUNNING"', how="max"),
                   "Jobs the coordinator is running now"),
            single("Aggregators up", "none", summed("tally_coordinator_aggregators_up", how="max"),
                   "Aggregators answering SERVING to the coordinator"),
            single("Open sessions", "none", summed("tally_coordinator_open_sessions"),
                   "Secure-aggregation sessions the running rounds hold open (one per cohort)"),
            single("Round p95", "s", p95("tally_coordinator_round_duration_seconds"),
                   "Round wall time, start to last sum applied"),
            single("Commit lag p95", "s", p95("tally_coordinator_commit_lag_seconds"),
                   "Checkpointing a round after its last sum"),
            graph("Current round", "none",
                  [summed("tally_coordinator_current_round", 'job_id=~"$job_id"', "job_id", how="max")],
                  "Round in progress per running job"),
            graph("Jobs by state", "none", [summed("tally_coordinator_jobs", by="state", how="max")],
                  "Jobs in the coordinator's store per state"),
            graph("Round outcomes", "ops", [
                per_second("tally_coordinator_rounds_committed_total", legend="committed"),
                per_second("tally_coordinator_rounds_retried_total", legend="retried"),
                per_second("tally_coordinator_rounds_failed_total", legend="failed"),
                per_second("tally_coordinator_cohort_sums_total", "outcome", "cohort sum {{outcome}}"),
            ], "Rounds committed, retried and failed, and cohort sums by outcome, per second"),
        ]),
        ("Phases", [
            graph("Round phases (p95)", "s", [p95("tally_coordinator_phase_duration_seconds", "phase")],
                  "Coordinator: selection, aggregation and update of each round attempt"),
            graph("Protocol phases on aggregators (p95)", "s",
                  [p95("tally_aggregator_phase_duration_seconds", "phase")],
                  "Aggregators: wall time of each secure-aggregation phase"),
            graph("Protocol phases on devices (p95)", "s", [p95("tally_client_phase_duration_seconds", "phase")],
                  "Devices: from the aggregator's request to the device's answer"),
            graph("Unmask CPU (p95, 15 min)", "s", [recorded("tally:aggregator_unmask_seconds:p95_15m", "unmask")],
                  "CPU time of the call that closes Unmask (recording rule; alert above 30 s)"),
            graph("Local computation (p95)", "s", [p95("tally_client_compute_seconds"),
                                                   p95("tally_client_download_seconds")],
                  "Devices: training and encoding one contribution; obtaining a model"),
            graph("Round wall time", "s", [p95("tally_coordinator_round_duration_seconds"),
                                           p95("tally_coordinator_commit_lag_seconds")],
                  "Round wall time and commit lag (p95)"),
        ]),
        ("Devices and dropouts", [
            graph("Check-ins", "ops", [per_second("tally_coordinator_checkins_total", "outcome")],
                  "Device check-ins per second by the coordinator's answer"),
            graph("Survivors per phase", "ops", [per_second("tally_aggregator_phase_devices_sum", "phase")],
                  "Devices that answered each phase before it closed, per second"),
            graph("Dropouts per phase", "ops", [per_second("tally_aggregator_dropouts_total", "phase")],
                  "Devices a phase expected that did not make it into the next, per second"),
            graph("Dropout ratio (10 min)", "percentunit",
                  [recorded("tally:aggregator_dropout_ratio:rate10m", "dropouts")],
                  "Devices lost by the phases over devices they expected (recording rule; alert above 30 %)"),
            graph("Sessions left early, device side", "ops",
                  [per_second("tally_client_dropouts_total", "phase, outcome", "{{outcome}} in {{phase}}")],
                  "Sessions devices left before the end, by phase"),
            graph("Clipped values (15 min)", "percentunit", [recorded("tally:client_clipped_ratio:rate15m", "clipped")],
                  "Encoded values outside their clip bound (recording rule; alert above 1 %)"),
        ]),
        ("Traffic", [
            graph("Coordinator", "Bps", [
                per_second("tally_coordinator_model_served_bytes_total", legend="models out"),
                per_second("tally_coordinator_cohort_sum_bytes_total", legend="cohort sums in"),
            ], "Bytes per second: models streamed to devices, cohort sums received from aggregators"),
            graph("Aggregators", "Bps", [
                per_second("tally_aggregator_received_bytes_total", legend="in"),
                per_second("tally_aggregator_sent_bytes_total", legend="out"),
            ], "Bytes per second of device messages"),
            graph("Devices", "Bps", [
                per_second("tally_client_upload_bytes_total", legend="up"),
                per_second("tally_client_download_bytes_total", "kind", "down ({{kind}})"),
            ], "Bytes per second the devices sent and received"),
        ]),
        ("Sessions", [
            graph("Open sessions", "none", [
                Query(summed("tally_aggregator_active_sessions").expr, per_namespace("aggregators")),
                Query(summed("tally_client_active_sessions").expr, per_namespace("devices")),
            ], "Secure-aggregation sessions open on the aggregators and on the devices"),
            graph("Session outcomes", "ops", [
                per_second("tally_aggregator_sessions_finished_total", "outcome", "aggregator {{outcome}}"),
                per_second("tally_client_sessions_total", "outcome", "device {{outcome}}"),
            ], "Sessions ended per second, by outcome"),
            graph("Refusals", "ops", [
                per_second("tally_coordinator_refusals_total", "rpc, reason", "{{rpc}} {{reason}}"),
                per_second("tally_aggregator_rejected_total", "reason", "aggregator {{reason}}"),
            ], "Calls and messages refused, by reason"),
        ]),
        ("Alerts and health", [
            listing("Firing alerts", summed("ALERTS", 'alertname=~"Tally.*", alertstate="firing"',
                                            "alertname, severity"),
                    "Tally alerts firing now (k8s/monitoring/rules.yaml)"),
            listing("Targets", summed("up", 'job=~"tally-.*"', "job, instance", how="max"),
                    "Scrape targets: 1 up, 0 down"),
            listing("Certificates", Query(summed("tally_tls_certificate_expiry_timestamp_seconds", by="role",
                                                 how="min").expr + " - time()"),
                    "Seconds until each role's TLS certificate expires (alert below 14 days)"),
            listing("Versions", summed("tally_build_info", by="role, version", how="count"),
                    "Processes per role and Tally version"),
            graph("CPU", "percentunit",
                  [per_second("process_cpu_seconds_total", "job", matchers='job=~"tally-.*"')],
                  "CPU seconds per second, per scrape job", 12),
            graph("Resident memory", "bytes", [summed("process_resident_memory_bytes", 'job=~"tally-.*"', "job")],
                  "Resident memory per scrape job", 12),
        ]),
        ("Failures", [
            graph("Devices' task failures by reason", "ops", [
                per_second("tally_coordinator_task_reports_total", "outcome, reason", "{{outcome}} {{reason}}",
                           FAILED_REPORTS)],
                  "Devices' reports on their tasks that did not complete, by outcome and reason, per second "
                  "(tally job status JOB gives a round's reasons with a device's own words)", 12),
            listing("Task failures over the time range", Query(
                f"sort_desc(sum by (namespace, outcome, reason) "
                f"(increase({series('tally_coordinator_task_reports_total', FAILED_REPORTS)}[$__range])))"),
                    "Devices' task reports that did not complete, by outcome and reason", 12),
            graph("Task failure share by reason (15 min)", "percentunit",
                  [recorded("tally:coordinator_task_failure_ratio:rate15m", "{{reason}}")],
                  "Reports failing for each reason over all reports, dropouts aside (recording rule; "
                  "alert above 10 %)"),
            graph("Round attempt failures (30 min)", "percentunit",
                  [recorded("tally:coordinator_round_attempt_failure_ratio:rate30m", "failed attempts")],
                  "Round attempts that failed over all attempts (recording rule; alert above 50 %)"),
            graph("Jobs failed", "none", [summed("tally_coordinator_jobs", 'state="FAILED"', how="max")],
                  "Jobs in the FAILED state (TallyJobFailed fires when this rises)"),
        ]),
        ("Model quality", [
            graph("Held-out accuracy", "percentunit", [
                summed("tally_coordinator_model_quality",
                       f'{IN_JOB}, metric=~"eval.accuracy|eval.accuracy_p10|personal.accuracy"', "job_id, metric",
                       how="max")],
                  "Per job, the latest committed round's accuracy on the devices' held-out examples "
                  "(example-weighted mean), the estimated mean of the worst decile of devices and, for a "
                  "personalised job, the personal models' accuracy: sums over the round's devices, never "
                  "one device's value (docs/evaluation.md)"),
            graph("Loss", "none", [
                summed("tally_coordinator_model_quality", f'{IN_JOB}, metric=~"eval.loss|train.loss"',
                       "job_id, metric", how="max")],
                  "Per job, the held-out loss of the model devices received and their training loss"),
            listing("Latest figures", summed("tally_coordinator_model_quality", IN_JOB, "job_id, metric", how="max"),
                    "Every model-quality figure of the selected jobs' latest committed rounds (per domain, "
                    "custom metrics too)", 8),
        ]),
    ]
    ids = iter(range(1, 1000))
    for title, panels in rows:
        board = board.with_row(dashboard.Row(title).id(next(ids)))
        for panel in panels:
            board = board.with_panel(panel.id(next(ids)))
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render() -> str:
    """dashboard.json's exact text."""
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def queries(document: dict) -> list[str]:
    """Every PromQL expression of a dashboard document, in panel order."""
    return [target["expr"] for panel in document["panels"] for target in panel.get("targets", [])]


if __name__ == "__main__":
    print(render(), end="")
