"""Benchmarks: scripts that measure and print figures (each states its method). A package only
so that tests import their pure helpers as ``bench.<module>``."""
