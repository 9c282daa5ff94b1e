"""``packstore serve``: the gRPC pack service over any store tier, torch-free: the servicer (``server.py``), one
store per namespace (``namespace_stores.py``), the bulk port (``bulk.py``) and its hot packs (``hot.py``), records as
messages (``to_messages.py``), metrics (``service_metrics.py``), and its settings (``config.py``)."""
