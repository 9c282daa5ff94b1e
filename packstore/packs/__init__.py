"""The pack reader over any store tier and what it decodes with.

``PackReader`` (``reader.py``) is the one place stored chunks are verified and decoded: packs, arriving packs and
parts. It decodes on a ``Decoder`` (``decoder.py``: the chunk threads) into a buffer provider (``buffers.py``,
``memory.py``); chunk bytes become tensors in ``tensors.py`` (and on a GPU in ``plane_join.py`` and
``device_decode.py``). Store-only operations (``admin.py``: inspect, verify, export, import, sign), ``migrate`` and
``backup`` sit here too, above the store's tiers and below the model side."""
