"""transformers models of a native architecture -> the matching coreformer models, with exact parity.

    convert_from_hf(model) -> coreformer model      dispatched to the architecture of `model`'s class
    SUPPORTED_ARCHITECTURES                         every native class it reads

What each architecture reads, refuses and renames lives in its own file of `coreformer.native` (bert.py, gpt2.py,
llama.py, ...), with the way back that export.py dispatches to; this module only finds the file and runs it.
"""

from transformers import PreTrainedModel

from ..modeling_base import CoreformerPreTrainedModel
from . import architecture_of_class, supported_classes
from .base import match_device_and_mode

SUPPORTED_ARCHITECTURES: tuple[str, ...] = supported_classes()


def convert_from_hf(model: PreTrainedModel) -> CoreformerPreTrainedModel:
    """The coreformer equivalent of a transformers model of a native architecture (`coreformer.native.NATIVE_NAMES`):
    same head, same weights.

    The returned model is in eval mode, on the source's device and dtype, with the source's attention backend
    (`config._attn_implementation`) and, for generative models, a copy of its `generation_config`.

    Conversions that are exact only with caveats (each architecture's file says more):
        - BertModel / RobertaModel: the pooler has no place in CoreformerEncoderModel and is dropped (the sequence
          classification heads keep it, as `classifier.dense`).
        - RoBERTa: positions are arange(T) + padding_idx + 1, equal to RoBERTa's cumsum of non-padding tokens for
          right-padded (or unpadded) batches only; padding positions themselves differ (nothing attends to them).
        - GPT-2: `token_type_ids`, which GPT-2 looks up in its token embedding, are ignored by the converted model.
        - Qwen2: coreformer's attention biases cover q, k, v and o; Qwen2 has none on o_proj, which gets a zero bias
          (exact, but fine-tuning then trains it). All-zero q/k/v biases convert to a model without biases.
        - ModernBERT: its multiple-choice head pools the first real token, coreformer's the first token: the same for
          right-padded batches. `sparse_prediction` is not kept (the same loss; logits for every token).
        - Training-time differences only: GPT-2's embedding dropout takes resid_pdrop (coreformer has one
          hidden_dropout), BART's activation dropout and layerdrop are not kept. With those equal (the defaults
          of GPT-2, and BART's activation_dropout=0, layerdrop=0), fine-tuning the converted model from the same seed
          on the same unpadded batches gives the source's losses, dropout included (tests/native/test_conversion.py).

    Args:
        model: an instantiated transformers model; `SUPPORTED_ARCHITECTURES` lists the classes.

    Raises:
        ValueError: for any other class, or a config option that coreformer cannot reproduce (named in the message).
    """
    source_name = type(model).__name__
    architecture = architecture_of_class(source_name)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if architecture is None or model_type != architecture.name:
        raise ValueError(
            f"convert_from_hf does not support {source_name} (model_type={model_type!r}); supported: "
            f"{', '.join(supported_classes())}."
        )
    converted = architecture.to_coreformer(model)
    match_device_and_mode(converted, model)
    converted.set_attn_implementation(model.config._attn_implementation)
    return converted.eval()
