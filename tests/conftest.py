"""Every test runs offline: none may reach the Hugging Face Hub (Hub ids resolve from caches the tests build,
tests/test_hub.py). Set here, before huggingface_hub, transformers or datasets are imported: they read it once."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
