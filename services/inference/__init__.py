"""The inference service: continuous-batching engine, model runner and gRPC front end."""
