"""The gRPC wire both ends speak, below the store: chunk pieces (``wire.py``), the bulk port's frames (``frames.py``),
errors as status codes (``status.py``), the namespace key and signature records (``fields.py``), and the client's channel
(``channel.py``: ``Connection``, ``GrpcClient``); the stubs are generated into ``packstore/v1`` (``codegen.py``). The
servers' plumbing is ``packstore/serving``; the store's gRPC client tier is ``packstore/store/remote``."""
