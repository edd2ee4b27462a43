"""The adapter store's domain: PEFT format checks, versioned object layout, storage backends.

Knows nothing of gRPC or the GPU; services/adapter_store translates to and from protobuf.
"""
