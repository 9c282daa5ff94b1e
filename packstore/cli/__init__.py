"""Command-line shells over the library: ``packctl`` (admin/user) and ``packstore`` (services)."""
