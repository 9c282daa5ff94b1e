"""packstore's tools, by kind: ``bench/`` benchmarks, ``eval/`` evaluations (and the doc tables made from their records),
``data/`` datasets and the synthetic fact generators, ``lib/`` what they share.

Every tool is a module run from the repository root, ``python -m tools.KIND.NAME ...``, and imports the others as
``tools.KIND.NAME``: no tool edits ``sys.path`` and none imports from tests/ (tests/unit/test_tools_layout.py checks both).
"""
