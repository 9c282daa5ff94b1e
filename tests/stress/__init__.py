"""Tests of kind ``stress`` (README, "Tests")."""
