"""Tally: federated learning in which the server side only ever sees sums.

The package is built in layers. A module imports its own layer or a lower one, never a higher one;
no service imports another (they talk over gRPC only); and no chain of imports leads back to where
it started. The rules are declared once, as import-linter contracts under ``[tool.importlinter]``
in pyproject.toml: ``lint-imports`` and tests/unit/test_layers.py check every import against them.
In words, lowest first:

plumbing     what every part shares: ``version``, ``logs`` (JSON lines), ``metrics`` (Prometheus
             registries and the metrics server), ``modelio`` (model bytes on disk and the wire),
             ``shutdown`` (how a serving process stops on SIGTERM or SIGINT)
protocol     torch-free, and all the aggregator needs: ``secagg`` (the secure sum, sans-IO),
             ``codec`` (fixed-point payloads), ``security`` (TLS, tokens, tickets, enrolment),
             ``wire`` (the gRPC stubs and proto converters)
algorithms   ``algorithms``: each algorithm's server and client halves, framework-free, sums only,
             and the options of a device's local adaptation
privacy      ``privacy``: differential privacy around any algorithm (clipping, noise, accounting)
models       ``models``: every torch model builder, ONNX export, state dict <-> arrays
training     ``training``: the torch trainers a device offers (plain, domain, energy, fair, personal)
datasets     ``datasets``: bundled and synthetic federated datasets, which hand devices trainers
services     ``coordinator``, ``aggregator`` and ``client`` (the SDK a device embeds): the three
             services, none importing another; the coordinator is itself in rooms (its docstring)
tools        ``sim`` (the in-process simulator and its reports), ``loadtest`` (the fleet simulator),
             ``ops`` (the process launcher, Kubernetes, the health probe), ``chaos`` (the fault
             campaign)
cli          ``cli``: the ``tally`` command, every subcommand, and the per-role console scripts
"""
