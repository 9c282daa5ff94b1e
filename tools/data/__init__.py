"""Evaluation data: the ckc rows and their frozen split, the steering pairs and prompts, and the independent synthetic
fact generators (second, third, fourth), each runnable as ``python -m tools.data.NAME`` to print its facts."""
