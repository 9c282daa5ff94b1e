"""What the tools share: timing and machine descriptions (``benchlib``), ckc rows, scoring and records (``evallib``),
running servers (``servers``, ``seaweed``) and synthetic packs (``packs``); imported, never run."""
