"""Tests of kind ``vllm`` (README, "Tests")."""
