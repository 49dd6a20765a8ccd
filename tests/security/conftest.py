"""Fixtures of the security tier: a tiny tokenizer and rollout engine built locally (no hub)."""

from __future__ import annotations

import pytest

from tests import endpoint_fixtures


@pytest.fixture(scope="session")
def tiny_tokenizer_and_engine(tmp_path_factory):
    return endpoint_fixtures.tiny_tokenizer_and_engine(tmp_path_factory.mktemp("tiny"))
