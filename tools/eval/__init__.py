"""Evaluations: quality measured on real and generated questions, each run as ``python -m tools.eval.NAME``, with records
under results/ and the tables of docs/evaluation.md made from them (``tools.eval.doc_tables``)."""
