"""Every test runs offline: none may reach the Hugging Face Hub (Hub ids resolve from caches the tests build,
tests/test_hub.py). Set here, before huggingface_hub, transformers or datasets are imported: they read it once."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs the vLLM engine (they skip without it); CI runs these again in "
                                       "the vLLM environment (.ci/run)")


def pytest_collection_modifyitems(config, items):
    """Mark every test that names vLLM in its own source or lives in a vLLM file, so that the vLLM environment's CI
    pass runs exactly those (``-m vllm``) rather than the whole suite a second time."""
    import inspect

    import pytest

    for item in items:
        fn = getattr(item, "function", None)
        try:
            source = inspect.getsource(fn) if fn is not None else ""
        except (OSError, TypeError):
            source = ""
        if "vllm" in item.fspath.basename or "vllm" in source.lower():
            item.add_marker(pytest.mark.vllm)
