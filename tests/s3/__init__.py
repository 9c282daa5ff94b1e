"""Tests of kind ``s3`` (README, "Tests")."""
