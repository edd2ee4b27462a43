"""Generated protobuf and gRPC code of the lorafleet.v1 API (make proto); do not edit."""
