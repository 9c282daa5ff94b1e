"""The gRPC pack service over the LMDB store: ``packstore serve``."""
