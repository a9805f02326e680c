"""A run of the default model for the downstream-evaluation tests, shared by the session."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny import train_default_model


@pytest.fixture(scope="session")
def default_run(tmp_path_factory) -> Path:
    return train_default_model(tmp_path_factory.mktemp("default_run"))
