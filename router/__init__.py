"""Router: public gRPC and OpenAI-compatible HTTP APIs; picks prefill and decode workers."""
