"""Fixtures shared by every folder of tests; torch-free, so the store and analysis tests need no torch."""

import os

import pytest

# No test touches the network: a hub id resolves from the cache only (tests build one in tmp_path).
os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="session", autouse=True)
def detjac_cache(tmp_path_factory: pytest.TempPathFactory):
    """Digests of weight files (runs/fingerprint.py) go to a folder of this session, not the user's ~/.cache."""
    os.environ["DETJAC_CACHE_DIR"] = str(tmp_path_factory.mktemp("detjac-cache"))
    yield os.environ["DETJAC_CACHE_DIR"]
