"""Shared fixtures. The plain helpers live in ``tests/tiny.py`` (import them
with ``from tiny import ...``); this file re-exports them and wraps them in
fixtures."""

from __future__ import annotations

import pytest

from tiny import (  # noqa: F401  (re-exported)
    ARCH_MATRIX,
    COMPRESSIBLE,
    PROFILE_ONLY,
    ffn_reference_modules,
    random_windows,
)
from tiny import tiny_model as _tiny_model


@pytest.fixture
def tiny_model():
    """Factory fixture: ``tiny_model("llama")`` → a fresh tiny random model."""
    return _tiny_model


@pytest.fixture(params=ARCH_MATRIX)
def arch(request) -> str:
    """Parametrises a test over every model type in :data:`ARCH_MATRIX`."""
    return request.param


@pytest.fixture(scope="module")
def torch_single_thread():
    """Run a module's tiny-model tests on one intra-op thread (restored after).

    Tiny matmuls gain nothing from threads, and on a busy machine the
    intra-op thread pool makes them many times slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if anything tries to load a model; returns the failing stand-in."""

    def boom(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("compressor.pipeline.stages.load_model", boom)
    monkeypatch.setattr("compressor.inputs.load.load_model", boom)
    return boom


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """The statistics cache in the test's own folder, and the hub offline: nothing outside is read or left."""
    d = tmp_path / "stats-cache"
    monkeypatch.setenv("COMPRESSOR_CACHE_DIR", str(d))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return d
