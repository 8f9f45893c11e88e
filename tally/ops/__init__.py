"""Running Tally as a deployment: the gRPC health probe the images and Kubernetes probes use, local
processes of each role, and the Kubernetes client behind ``tally k8s`` (the commands and the
per-role entry points are in ``tally.cli``). Importing this package imports nothing heavy: the
aggregator's image has no torch, and its probe lives here."""
