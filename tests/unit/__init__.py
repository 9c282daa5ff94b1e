"""Tests of kind ``unit`` (README, "Tests")."""
