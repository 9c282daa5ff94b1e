"""Model side: load models, fingerprint them, build packs, inject them and generate."""
