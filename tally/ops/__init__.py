"""Running Tally as a deployment: per-role entry points, the gRPC health probe the images and
Kubernetes probes use, and ``tally k8s``. Importing this package imports nothing heavy: the
aggregator's image has no torch, and its entry point lives here."""
