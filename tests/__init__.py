"""packstore's tests: a directory per kind (README, "Tests"), helpers in ``tests.helpers``."""
