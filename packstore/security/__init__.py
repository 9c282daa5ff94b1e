"""Who may do what: tokens, roles and namespaces (``auth.py``), fair shares of scarce resources among principals
(``shares.py``), Ed25519 signing and trusted keys (``trust.py``). Above the store (a namespace's name), below both
servers (``serving``, ``service``, ``worker``) and the pack reader (verifying signatures)."""
