"""The job spec: its YAML typed and validated, its generated reference and starter specs, and the
catalogue of algorithms and models a job may name. Lowest room of the coordinator: no I/O, no state."""
