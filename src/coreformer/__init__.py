"""coreformer: BERT-, GPT- and BART-style transformers over one shared attention core, native to transformers v5.

Importing the package registers every config and model with AutoConfig / AutoModel*, and marks every class for
`save_pretrained` to copy its code next to the weights (so a folder also loads with `trust_remote_code=True` where
coreformer is not installed).
"""

import importlib

import transformers

from . import configuration_coreformer
from .configuration_coreformer import (
    CoreformerConfig,
    CoreformerDecoderConfig,
    CoreformerEncoderConfig,
    CoreformerSeq2SeqConfig,
)
from .export import export_to, to_native
from .families import FAMILIES
from .modeling_decoder import (
    CoreformerDecoderForCausalLM,
    CoreformerDecoderForSequenceClassification,
    CoreformerDecoderForTokenClassification,
    CoreformerDecoderModel,
)
from .modeling_encoder import (
    CoreformerEncoderForMaskedLM,
    CoreformerEncoderForMultipleChoice,
    CoreformerEncoderForQuestionAnswering,
    CoreformerEncoderForSequenceClassification,
    CoreformerEncoderForTokenClassification,
    CoreformerEncoderModel,
)
from .modeling_seq2seq import (
    CoreformerSeq2SeqForConditionalGeneration,
    CoreformerSeq2SeqForSequenceClassification,
    CoreformerSeq2SeqModel,
)
from .native.conversion import convert_from_hf
from .pipelines import save_with_pipeline  # importing registers the custom QA and text2text pipeline tasks

__version__ = "0.1.0"

# Registration, read from the family registry (families.py): AutoConfig and every Auto class of every family, each
# class also marked for save_pretrained to copy its code (the config's auto_map names them all).
for _family in FAMILIES.values():
    _config_class = getattr(configuration_coreformer, _family.config_class)
    transformers.AutoConfig.register(_family.model_type, _config_class, exist_ok=True)
    _config_class.register_for_auto_class("AutoConfig")
    _module = importlib.import_module(f".{_family.module}", __name__)
    for _head in _family.heads:
        _model_class = getattr(_module, _head.class_name)
        getattr(transformers, _head.auto_class).register(_config_class, _model_class, exist_ok=True)
        _model_class.register_for_auto_class(_head.auto_class)

__all__ = [
    "FAMILIES",
    "CoreformerConfig",
    "CoreformerEncoderConfig",
    "CoreformerDecoderConfig",
    "CoreformerSeq2SeqConfig",
    "CoreformerEncoderModel",
    "CoreformerEncoderForMaskedLM",
    "CoreformerEncoderForSequenceClassification",
    "CoreformerEncoderForTokenClassification",
    "CoreformerEncoderForQuestionAnswering",
    "CoreformerEncoderForMultipleChoice",
    "CoreformerDecoderModel",
    "CoreformerDecoderForCausalLM",
    "CoreformerDecoderForSequenceClassification",
    "CoreformerDecoderForTokenClassification",
    "CoreformerSeq2SeqModel",
    "CoreformerSeq2SeqForConditionalGeneration",
    "CoreformerSeq2SeqForSequenceClassification",
    "convert_from_hf",
    "export_to",
    "to_native",
    "save_with_pipeline",
]
