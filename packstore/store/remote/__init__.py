"""The gRPC client tier (``grpc://``, ``grpcs://``): ``RemoteStore``, a ``PackStore`` over ``packstore serve``."""
