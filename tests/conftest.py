"""Fixtures shared by every folder of tests; torch-free, so the store and analysis tests need no torch."""
