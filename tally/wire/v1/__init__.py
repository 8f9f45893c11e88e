"""Generated protobuf and gRPC stubs of the tally.v1 wire contract."""
