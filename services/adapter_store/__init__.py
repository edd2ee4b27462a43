"""The adapter store gRPC service: python -m services.adapter_store."""
