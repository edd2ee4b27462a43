"""The HTTP gateway: an OpenAI-compatible API and a REST adapter registry over the gRPC services."""
