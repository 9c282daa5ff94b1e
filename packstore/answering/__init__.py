"""The one answering path: ``Answerer`` (``answer.py``: a model, a store and the ready packs it answers with; refs or
a bank -> packs -> tokens), the caches of ready packs (``ready_caches.py``: on the model's device, and on a worker in host
memory under it), composing packs (``composing.py``), the Python API packctl shells over (``api.py``), and the
engine-free planning of packs for a paged-attention engine (``paged.py``)."""
