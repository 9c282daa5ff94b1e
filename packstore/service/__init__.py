"""``packstore serve``: the gRPC pack service over any store tier, torch-free: the servicer (``server.py``), one
store per namespace (``namespaces.py``), the bulk port (``bulk.py``) and its hot packs (``hot.py``), records as
messages (``to_messages.py``), metrics, and its settings (``config.py``)."""
