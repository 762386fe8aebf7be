"""Fixtures of fe-eval's unit tests."""

import pytest


@pytest.fixture(scope="module")
def uniform_dir(small_data, tmp_path_factory):
    """A saved model whose every weight is zero, with small_data's tokenizer (tests.helpers.evaluation)."""
    from tests.helpers.evaluation import uniform_model

    return uniform_model(str(tmp_path_factory.mktemp("uniform")), small_data["tokenizer"])
