"""Fixtures shared by every folder of tests; torch-free, so the store and analysis tests need no torch."""

import os

# No test touches the network: a hub id resolves from the cache only (tests build one in tmp_path).
os.environ["HF_HUB_OFFLINE"] = "1"
