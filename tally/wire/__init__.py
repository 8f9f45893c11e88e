"""The wire contract: generated protobuf/gRPC stubs (``tally.wire.v1``) and conversions between
them and plain values, one module per concern: the protocol's messages and stream envelopes
(``protocol``), arrays (``tensors``), sum schemas and cohort totals (``sums``), and the structural
checks and ``WireError`` they share (``fields``).

Kept free of imports so that ``python -m tally.wire.generate`` runs even when the stubs are stale.
"""
