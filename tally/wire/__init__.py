"""The wire contract: generated protobuf/gRPC stubs (``tally.wire.v1``) and conversions between
them and the protocol's plain values (``tally.wire.convert``).

Kept free of imports so that ``python -m tally.wire.generate`` runs even when the stubs are stale.
"""
