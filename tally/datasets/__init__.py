"""Federated datasets generated in process or built from bundled data: one module per dataset."""
