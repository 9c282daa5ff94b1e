"""The worker sidecar: ``packstore worker`` loads a model, fetches packs and serves Generate."""
