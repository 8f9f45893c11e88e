"""Tally: federated learning in which the server side only ever sees sums.

The module map, by layer, lowest first. A module imports its own layer or a lower one, never a
higher one, no service imports another, and no import chain leads back to where it started:
tests/unit/test_layers.py checks every import against this list.

plumbing     what every part shares: ``version``, ``logs`` (JSON lines), ``metrics`` (Prometheus
             registries and the metrics server), ``modelio`` (model bytes on disk and the wire)
protocol     torch-free, and all the aggregator needs: ``secagg`` (the secure sum, sans-IO),
             ``codec`` (fixed-point payloads), ``security`` (TLS, tokens, tickets, enrolment),
             ``wire`` (the gRPC stubs and proto converters)
algorithms   ``algorithms``: each algorithm's server and client halves, framework-free, sums only;
             ``adaptation_options``: the options of a device's local adaptation
privacy      ``privacy``: differential privacy around any algorithm (clipping, noise, accounting)
models       ``models``: every torch model builder, ONNX export, state dict <-> arrays
training     ``training``: the torch trainers a device offers (plain, domain, energy, fair, personal)
datasets     ``datasets``: bundled and synthetic federated datasets, which hand devices trainers
services     ``coordinator``, ``aggregator`` and ``client`` (the SDK a device embeds): the three services
tools        ``sim`` (the in-process simulator and its reports), ``ops`` (processes, Kubernetes,
             the health probe), ``chaos`` (the fault campaign), ``research`` (paper reproductions,
             no part of the product)
cli          ``cli``: the ``tally`` command, every subcommand, and the per-role console scripts
"""
