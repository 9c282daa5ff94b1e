"""Tests of kind ``install`` (README, "Tests")."""
