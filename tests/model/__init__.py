"""Tests of kind ``model`` (README, "Tests")."""
