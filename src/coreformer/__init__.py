"""coreformer: BERT-, GPT- and BART-style transformers over one shared attention core, native to transformers v5.

Importing the package registers every config and model with AutoConfig / AutoModel*, and marks every class for
`save_pretrained` to copy its code next to the weights (so a folder also loads with `trust_remote_code=True` where
coreformer is not installed).
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .configuration_coreformer import (
    CoreformerConfig,
    CoreformerDecoderConfig,
    CoreformerEncoderConfig,
    CoreformerSeq2SeqConfig,
)
from .conversion import convert_from_hf
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
from .pipelines import save_with_pipeline  # importing registers the custom QA and text2text pipeline tasks

__version__ = "0.1.0"

_AUTO_CLASSES = {
    CoreformerEncoderConfig: {
        AutoModel: CoreformerEncoderModel,
        AutoModelForMaskedLM: CoreformerEncoderForMaskedLM,
        AutoModelForSequenceClassification: CoreformerEncoderForSequenceClassification,
        AutoModelForTokenClassification: CoreformerEncoderForTokenClassification,
        AutoModelForQuestionAnswering: CoreformerEncoderForQuestionAnswering,
        AutoModelForMultipleChoice: CoreformerEncoderForMultipleChoice,
    },
    CoreformerDecoderConfig: {
        AutoModel: CoreformerDecoderModel,
        AutoModelForCausalLM: CoreformerDecoderForCausalLM,
        AutoModelForSequenceClassification: CoreformerDecoderForSequenceClassification,
        AutoModelForTokenClassification: CoreformerDecoderForTokenClassification,
    },
    CoreformerSeq2SeqConfig: {
        AutoModel: CoreformerSeq2SeqModel,
        AutoModelForSeq2SeqLM: CoreformerSeq2SeqForConditionalGeneration,
        AutoModelForSequenceClassification: CoreformerSeq2SeqForSequenceClassification,
    },
}

for _config_class, _models in _AUTO_CLASSES.items():
    AutoConfig.register(_config_class.model_type, _config_class, exist_ok=True)
    _config_class.register_for_auto_class("AutoConfig")
    for _auto_class, _model_class in _models.items():
        _auto_class.register(_config_class, _model_class, exist_ok=True)
        _model_class.register_for_auto_class(_auto_class.__name__)

__all__ = [
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
    "save_with_pipeline",
]
