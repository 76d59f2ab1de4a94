"""rayturn.api: every wire protocol (OpenAI HTTP, gRPC), the ingress deployment and its call pipeline."""
