"""Tests of kind ``eval`` (README, "Tests")."""
