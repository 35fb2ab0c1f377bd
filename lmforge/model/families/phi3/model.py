"""Phi-3's model: the shared transformer as it is (``model.transformer.Block``); only the Hugging Face
layout of its weights differs (``hf.py``)."""

from lmforge.model.families.phi3.config import Phi3Config
from lmforge.model.transformer import Transformer


class Phi3(Transformer):
    """Pre-norm blocks of the shared parts, configured by a ``Phi3Config``."""

    config_class = Phi3Config
