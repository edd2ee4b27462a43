"""lorafleet's gRPC services: the adapter store and the inference service."""
