"""gRPC plumbing shared by the service, its client and the worker: generated stubs and status mapping."""
