import shutil

import pytest

from lmforge.data.chat import add_chat_template


@pytest.fixture(scope="module")
def chat_tokenizer_dir(small_tokenizer_dir, tmp_path_factory):
    """The small test tokenizer with the ChatML template and special tokens added."""
    path = tmp_path_factory.mktemp("chat_tokenizer")
    for f in small_tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    add_chat_template(path)
    return path
