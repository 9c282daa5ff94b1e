"""What both servers (the store service and the worker) run on: the gRPC scaffold, listeners and TLS, the metrics
endpoint, and the pacing of slow streams."""
