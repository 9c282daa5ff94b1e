"""Tests of kind ``service`` (README, "Tests")."""
