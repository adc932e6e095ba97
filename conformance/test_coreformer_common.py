"""transformers' common model tests run against coreformer's three families (reference suite, outside the project).

run.sh copies this file to upstream/tests/models/coreformer/test_modeling_coreformer.py, next to transformers' own
tests/models/{bert,gpt2,bart}, and runs it with the checkout's .venv python. The testers mirror the in-library ones:

    CoreformerEncoderModelTest   <- BertModelTest   (ModelTesterMixin, PipelineTesterMixin; BertModelTester's shapes)
    CoreformerDecoderModelTest   <- GPT2ModelTest   (CausalLMModelTest: Model/Generation/Pipeline/Training/TP/FSDP
                                                     mixins; the CausalLMModelTester defaults GPT-2 uses)
    CoreformerSeq2SeqModelTest   <- BartModelTest   (ModelTesterMixin, GenerationTesterMixin, PipelineTesterMixin;
                                                     BartModelTester's shapes)
    CoreformerDecoderLlamaSlidingModelTest <- GPT2ModelTest, same tester with rotary/RMSNorm/SwiGLU/MQA and
                                                     ["full", "sliding"] layers (beyond the references: no in-library
                                                     model of that shape is in the comparison)

Structural differences (true, not skips of convenience):
- The encoder family has no generative head (BERT has BertLMHeadModel): transformers' own check
  (test_modeling_common, "can't call `generate`, so its tester can't inherit `GenerationTesterMixin`") forbids mixing
  GenerationTesterMixin into a test class whose models cannot generate, so the encoder test class has none.
- BERT's NSP / pretraining heads, GPT-2's double-heads model, BART's QA head and BartForCausalLM have no coreformer
  counterpart; their model-specific tests are not mirrored.
- coreformer's stacks are nn.Modules, not PreTrainedModels (BartEncoder/BartDecoder are), so BART's
  test_encoder_decoder_model_standalone (saves and reloads each stack on its own) has no counterpart.

transformers' generation tests skip assisted decoding for every class whose name contains "reformer" (meant for
Reformer's old cache format), and "coreformer" does: the generation tests run on subclasses of the generative heads
named without it (`GeneratesUnderANameWithoutReformer`), the same code under another name.
"""

import copy
import tempfile
import unittest
import unittest.mock

import coreformer  # registers every class with the Auto classes
import transformers
from transformers import is_torch_available
from transformers.testing_utils import require_torch, torch_device

from ...causal_lm_tester import CausalLMModelTest, CausalLMModelTester
from ...generation.test_utils import GenerationTesterMixin
from ...test_configuration_common import ConfigTester
from ...test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask
from ...test_pipeline_mixin import PipelineTesterMixin


_RENAMED: dict[type, type] = {}


def _without_reformer(model_class: type) -> type:
    """A subclass of `model_class` named without "reformer" (CoreformerDecoderForCausalLM -> CFDecoderForCausalLM)."""
    if model_class not in _RENAMED:
        name = model_class.__name__.replace("Coreformer", "CF")
        _RENAMED[model_class] = type(name, (model_class,), {"__module__": model_class.__module__})
    return _RENAMED[model_class]


class GeneratesUnderANameWithoutReformer:
    """The generation tests see the generative heads as subclasses named without "reformer" (see the docstring)."""

    @property
    def all_generative_model_classes(self):
        return tuple(_without_reformer(model_class) for model_class in super().all_generative_model_classes)

    def test_inherits_generation_mixin(self):
        # transformers' check reads the class's own bases, which for a renamed subclass is the original class: it is
        # asked of the original generative heads instead.
        for model_class in super().all_generative_model_classes:
            self.assertTrue("GenerationMixin" in str(model_class.__bases__))


if is_torch_available():
    import torch

    from coreformer import (
        CoreformerDecoderConfig,
        CoreformerDecoderForCausalLM,
        CoreformerDecoderForSequenceClassification,
        CoreformerDecoderForTokenClassification,
        CoreformerDecoderModel,
        CoreformerEncoderConfig,
        CoreformerEncoderForMaskedLM,
        CoreformerEncoderForMultipleChoice,
        CoreformerEncoderForQuestionAnswering,
        CoreformerEncoderForSequenceClassification,
        CoreformerEncoderForTokenClassification,
        CoreformerEncoderModel,
        CoreformerSeq2SeqConfig,
        CoreformerSeq2SeqForConditionalGeneration,
        CoreformerSeq2SeqForSequenceClassification,
        CoreformerSeq2SeqModel,
    )
    from transformers.models.auto import modeling_auto


def _list_in_transformers_name_tables() -> None:
    """transformers' test harness decides how to build inputs and labels per class from the static tables of
    in-library class names (`modeling_auto.*_MAPPING_NAMES`: e.g. `_prepare_for_class` expands inputs for classes
    listed under multiple choice, `test_training` leaves out classes listed as base models). Classes registered with
    `AutoModel*.register` (coreformer's) are not in those tables, so the harness would treat every coreformer head as
    an unknown class. List each class under exactly the Auto class coreformer registers it with, as an in-library
    model is listed. Only this test module's processes see the change; the lazy
    Auto mappings ignore model types absent from CONFIG_MAPPING_NAMES, so loading is unaffected."""
    tables = {
        transformers.AutoModel: modeling_auto.MODEL_MAPPING_NAMES,
        transformers.AutoModelForMaskedLM: modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        transformers.AutoModelForCausalLM: modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        transformers.AutoModelForSeq2SeqLM: modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        transformers.AutoModelForSequenceClassification: modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
        transformers.AutoModelForTokenClassification: modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
        transformers.AutoModelForQuestionAnswering: modeling_auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
        transformers.AutoModelForMultipleChoice: modeling_auto.MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES,
    }
    for auto_class, names in tables.items():
        # What `AutoX.register` recorded for coreformer's configs when `import coreformer` ran.
        for config_class, model_class in auto_class._model_mapping._extra_content.items():
            if config_class.__module__.startswith("coreformer."):
                names[config_class.model_type] = model_class.__name__


if is_torch_available():
    _list_in_transformers_name_tables()


# ---------------------------------------------------------------------------------------------------------- encoder
class CoreformerEncoderModelTester:
    """BertModelTester's sizes and inputs (batch 13, seq 7, vocab 99, hidden 32, 2 layers, 4 heads, ffn 37)."""

    def __init__(
        self,
        parent,
        batch_size=13,
        seq_length=7,
        is_training=True,
        use_input_mask=True,
        use_token_type_ids=True,
        use_labels=True,
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        hidden_act="gelu",
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        max_position_embeddings=512,
        type_vocab_size=16,
        type_sequence_label_size=2,
        initializer_range=0.02,
        num_labels=3,
        num_choices=4,
    ):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.use_input_mask = use_input_mask
        self.use_token_type_ids = use_token_type_ids
        self.use_labels = use_labels
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        self.type_sequence_label_size = type_sequence_label_size
        self.initializer_range = initializer_range
        self.num_labels = num_labels
        self.num_choices = num_choices

    def get_config(self):
        return CoreformerEncoderConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            intermediate_size=self.intermediate_size,
            hidden_act=self.hidden_act,
            hidden_dropout=self.hidden_dropout_prob,
            attention_dropout=self.attention_probs_dropout_prob,
            max_position_embeddings=self.max_position_embeddings,
            type_vocab_size=self.type_vocab_size,
            initializer_range=self.initializer_range,
        )

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        input_mask = random_attention_mask([self.batch_size, self.seq_length]) if self.use_input_mask else None
        token_type_ids = None
        if self.use_token_type_ids:
            token_type_ids = ids_tensor([self.batch_size, self.seq_length], self.type_vocab_size)
        sequence_labels = token_labels = choice_labels = None
        if self.use_labels:
            sequence_labels = ids_tensor([self.batch_size], self.type_sequence_label_size)
            token_labels = ids_tensor([self.batch_size, self.seq_length], self.num_labels)
            choice_labels = ids_tensor([self.batch_size], self.num_choices)
        config = self.get_config()
        return config, input_ids, token_type_ids, input_mask, sequence_labels, token_labels, choice_labels

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, token_type_ids, input_mask, *_ = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": input_mask}

    # The checks below are BertModelTester's, for the heads coreformer has.
    def create_and_check_model(self, config, input_ids, token_type_ids, input_mask, *labels):
        model = CoreformerEncoderModel(config).to(torch_device).eval()
        model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids)
        model(input_ids, token_type_ids=token_type_ids)
        result = model(input_ids)
        self.parent.assertEqual(result.last_hidden_state.shape, (self.batch_size, self.seq_length, self.hidden_size))

    def create_and_check_for_masked_lm(self, config, input_ids, token_type_ids, input_mask, seq_labels, tok_labels, _):
        model = CoreformerEncoderForMaskedLM(config).to(torch_device).eval()
        result = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids, labels=tok_labels)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.seq_length, self.vocab_size))

    def create_and_check_for_question_answering(self, config, input_ids, token_type_ids, input_mask, seq_labels, *_):
        model = CoreformerEncoderForQuestionAnswering(config).to(torch_device).eval()
        result = model(
            input_ids,
            attention_mask=input_mask,
            token_type_ids=token_type_ids,
            start_positions=seq_labels,
            end_positions=seq_labels,
        )
        self.parent.assertEqual(result.start_logits.shape, (self.batch_size, self.seq_length))
        self.parent.assertEqual(result.end_logits.shape, (self.batch_size, self.seq_length))

    def create_and_check_for_sequence_classification(self, config, input_ids, token_type_ids, input_mask, seq, *_):
        config.num_labels = self.num_labels
        model = CoreformerEncoderForSequenceClassification(config).to(torch_device).eval()
        result = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids, labels=seq)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.num_labels))

    def create_and_check_for_token_classification(self, config, input_ids, token_type_ids, input_mask, _, tok, __):
        config.num_labels = self.num_labels
        model = CoreformerEncoderForTokenClassification(config).to(torch_device).eval()
        result = model(input_ids, attention_mask=input_mask, token_type_ids=token_type_ids, labels=tok)
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.seq_length, self.num_labels))

    def create_and_check_for_multiple_choice(self, config, input_ids, token_type_ids, input_mask, _, __, choices):
        config.num_choices = self.num_choices
        model = CoreformerEncoderForMultipleChoice(config).to(torch_device).eval()

        def expand(tensor):
            return tensor.unsqueeze(1).expand(-1, self.num_choices, -1).contiguous()

        result = model(
            expand(input_ids),
            attention_mask=expand(input_mask),
            token_type_ids=expand(token_type_ids),
            labels=choices,
        )
        self.parent.assertEqual(result.logits.shape, (self.batch_size, self.num_choices))


@require_torch
class CoreformerEncoderModelTest(ModelTesterMixin, PipelineTesterMixin, unittest.TestCase):
    all_model_classes = (
        (
            CoreformerEncoderModel,
            CoreformerEncoderForMaskedLM,
            CoreformerEncoderForMultipleChoice,
            CoreformerEncoderForQuestionAnswering,
            CoreformerEncoderForSequenceClassification,
            CoreformerEncoderForTokenClassification,
        )
        if is_torch_available()
        else ()
    )
    pipeline_model_mapping = (
        {
            "feature-extraction": CoreformerEncoderModel,
            "fill-mask": CoreformerEncoderForMaskedLM,
            "text-classification": CoreformerEncoderForSequenceClassification,
            "token-classification": CoreformerEncoderForTokenClassification,
            "zero-shot": CoreformerEncoderForSequenceClassification,
        }
        if is_torch_available()
        else {}
    )
    model_split_percents = [0.5, 0.8, 0.9]  # BertModelTest's

    def setUp(self):
        self.model_tester = CoreformerEncoderModelTester(self)
        self.config_tester = ConfigTester(self, config_class=CoreformerEncoderConfig, hidden_size=32)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_model(self):
        self.model_tester.create_and_check_model(*self.model_tester.prepare_config_and_inputs())

    def test_for_masked_lm(self):
        self.model_tester.create_and_check_for_masked_lm(*self.model_tester.prepare_config_and_inputs())

    def test_for_multiple_choice(self):
        self.model_tester.create_and_check_for_multiple_choice(*self.model_tester.prepare_config_and_inputs())

    def test_for_question_answering(self):
        self.model_tester.create_and_check_for_question_answering(*self.model_tester.prepare_config_and_inputs())

    def test_for_sequence_classification(self):
        self.model_tester.create_and_check_for_sequence_classification(*self.model_tester.prepare_config_and_inputs())

    def test_for_token_classification(self):
        self.model_tester.create_and_check_for_token_classification(*self.model_tester.prepare_config_and_inputs())


# ---------------------------------------------------------------------------------------------------------- decoder
class CoreformerDecoderModelTester(CausalLMModelTester):
    """GPT2ModelTester is a CausalLMModelTester; so is this one (its defaults: batch 13, seq 7, vocab 99, hidden 32,
    2 layers, 2 heads). transformers infers the other classes from `base_model_class` by looking them up in its own
    package, which cannot find an out-of-tree model's classes, so they are named here (all of the decoder's heads;
    coreformer's decoder has no question-answering head)."""

    if is_torch_available():
        base_model_class = CoreformerDecoderModel
        config_class = CoreformerDecoderConfig
        causal_lm_class = CoreformerDecoderForCausalLM
        sequence_classification_class = CoreformerDecoderForSequenceClassification
        token_classification_class = CoreformerDecoderForTokenClassification


@require_torch
class CoreformerDecoderModelTest(GeneratesUnderANameWithoutReformer, CausalLMModelTest, unittest.TestCase):
    model_tester_class = CoreformerDecoderModelTester
    model_split_percents = [0.5, 0.6, 0.7]  # GPT2ModelTest's


class CoreformerDecoderLlamaSlidingModelTester(CoreformerDecoderModelTester):
    """The same tester with a Llama-style block and mixed attention: rotary positions, RMSNorm, SwiGLU, multi-query
    attention (1 key/value head), layers ["full", "sliding"]. No in-library counterpart of its own: its results are
    compared, per test name, with GPT-2's (the in-library decoder under the same tester).

    The window is wider than any sequence the common tests build, as in transformers' own sliding-window testers
    (their cache-shape checks assume no eviction; e.g. Dots3NoteTextModelTester sets sliding_window to
    max_position_embeddings): the sliding layers still run through the sliding code path (mask, cache layer type,
    kernels), and test_sliding_window_mask sets a small window itself."""

    def __init__(self, parent, **kwargs):
        super().__init__(
            parent,
            position_embedding_type="rotary",
            norm_type="rmsnorm",
            gated_mlp=True,
            hidden_act="silu",
            num_key_value_heads=1,
            layer_types=["full", "sliding"],
            sliding_window=64,
            **kwargs,
        )


@require_torch
class CoreformerDecoderLlamaSlidingModelTest(GeneratesUnderANameWithoutReformer, CausalLMModelTest, unittest.TestCase):
    model_tester_class = CoreformerDecoderLlamaSlidingModelTester
    model_split_percents = [0.5, 0.6, 0.7]


# ---------------------------------------------------------------------------------------------------------- seq2seq
class CoreformerSeq2SeqModelTester:
    """BartModelTester's sizes and inputs (batch 13, seq 7, vocab 99, hidden 16, 2+2 layers, 4 heads, ffn 4,
    max positions 50, bos 0 / pad 1 / eos 2)."""

    def __init__(
        self,
        parent,
        batch_size=13,
        seq_length=7,
        is_training=True,
        use_labels=False,
        vocab_size=99,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=4,
        hidden_act="gelu",
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        max_position_embeddings=50,
        eos_token_id=2,
        pad_token_id=1,
        bos_token_id=0,
    ):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = is_training
        self.use_labels = use_labels
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id

    def get_config(self):
        return CoreformerSeq2SeqConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            encoder_layers=self.num_hidden_layers,
            decoder_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            intermediate_size=self.intermediate_size,
            hidden_act=self.hidden_act,
            hidden_dropout=self.hidden_dropout_prob,
            attention_dropout=self.attention_probs_dropout_prob,
            max_position_embeddings=self.max_position_embeddings,
            eos_token_id=self.eos_token_id,
            bos_token_id=self.bos_token_id,
            pad_token_id=self.pad_token_id,
        )

    def get_pipeline_config(self):
        config = self.get_config()
        config.max_position_embeddings = 100
        config.vocab_size = 300
        return config

    def prepare_config_and_inputs(self):
        # BartModelTester's inputs (prepare_bart_inputs_dict): ids >= 3 ending in eos; decoder_attention_mask is the
        # source mask, as BART's helper builds it.
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size).clamp(3)
        input_ids[:, -1] = self.eos_token_id
        decoder_input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        config = self.get_config()
        attention_mask = input_ids.ne(config.pad_token_id)
        inputs_dict = {
            "input_ids": input_ids,
            "decoder_input_ids": decoder_input_ids,
            "attention_mask": attention_mask,
            "decoder_attention_mask": attention_mask,
        }
        return config, inputs_dict

    def prepare_config_and_inputs_for_common(self):
        return self.prepare_config_and_inputs()

    def create_and_check_decoder_model_past_large_inputs(self, config, inputs_dict):
        """BART's check, through the full model (coreformer's decoder stack always cross-attends to an encoder)."""
        model = CoreformerSeq2SeqModel(config).to(torch_device).eval()
        input_ids = inputs_dict["input_ids"]
        attention_mask = inputs_dict["attention_mask"]
        encoder_outputs = model.get_encoder()(input_ids, attention_mask=attention_mask)
        decoder_ids = inputs_dict["decoder_input_ids"]
        outputs = model(
            encoder_outputs=encoder_outputs,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_ids,
            use_cache=True,
        )
        past_key_values = outputs.past_key_values
        next_tokens = ids_tensor((self.batch_size, 3), config.vocab_size)
        next_mask = ids_tensor((self.batch_size, 3), 2)
        next_ids = torch.cat([decoder_ids, next_tokens], dim=-1)
        next_attention = torch.cat([torch.ones_like(decoder_ids), next_mask], dim=-1)
        no_past = model(
            encoder_outputs=encoder_outputs,
            attention_mask=attention_mask,
            decoder_input_ids=next_ids,
            decoder_attention_mask=next_attention,
        ).last_hidden_state
        with_past = model(
            encoder_outputs=encoder_outputs,
            attention_mask=attention_mask,
            decoder_input_ids=next_tokens,
            decoder_attention_mask=next_attention,
            past_key_values=past_key_values,
        ).last_hidden_state
        index = ids_tensor((1,), with_past.shape[-1]).item()
        self.parent.assertEqual(with_past.shape[1], next_tokens.shape[1])
        self.parent.assertTrue(torch.allclose(with_past[:, :, index], no_past[:, -3:, index], atol=1e-3))


@require_torch
class CoreformerSeq2SeqModelTest(
    GeneratesUnderANameWithoutReformer, ModelTesterMixin, GenerationTesterMixin, PipelineTesterMixin, unittest.TestCase
):
    all_model_classes = (
        (CoreformerSeq2SeqModel, CoreformerSeq2SeqForConditionalGeneration, CoreformerSeq2SeqForSequenceClassification)
        if is_torch_available()
        else ()
    )
    pipeline_model_mapping = (
        {
            "feature-extraction": CoreformerSeq2SeqModel,
            "fill-mask": CoreformerSeq2SeqForConditionalGeneration,
            "text-classification": CoreformerSeq2SeqForSequenceClassification,
            "zero-shot": CoreformerSeq2SeqForSequenceClassification,
        }
        if is_torch_available()
        else {}
    )
    is_encoder_decoder = True

    def setUp(self):
        self.model_tester = CoreformerSeq2SeqModelTester(self)
        self.config_tester = ConfigTester(self, config_class=CoreformerSeq2SeqConfig)

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_save_load_strict(self):
        config, _ = self.model_tester.prepare_config_and_inputs()
        for model_class in self.all_model_classes:
            model = model_class(config)
            with tempfile.TemporaryDirectory() as tmpdirname:
                model.save_pretrained(tmpdirname)
                _, info = model_class.from_pretrained(tmpdirname, output_loading_info=True)
            self.assertEqual(info["missing_keys"], set())

    def test_decoder_model_past_with_large_inputs(self):
        self.model_tester.create_and_check_decoder_model_past_large_inputs(
            *self.model_tester.prepare_config_and_inputs()
        )

    # BartModelTest's override: the sequence classifier pools the last eos token, found from input_ids, so it takes
    # no inputs_embeds (same design in coreformer's seq2seq classifier).
    def test_inputs_embeds(self):
        config, inputs_dict = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in (CoreformerSeq2SeqModel, CoreformerSeq2SeqForConditionalGeneration):
            model = model_class(config).to(torch_device).eval()
            inputs = copy.deepcopy(self._prepare_for_class(inputs_dict, model_class))
            encoder_input_ids = inputs.pop("input_ids")
            decoder_input_ids = inputs.pop("decoder_input_ids", encoder_input_ids)
            embeddings = model.get_input_embeddings()
            inputs["inputs_embeds"] = embeddings(encoder_input_ids)
            inputs["decoder_inputs_embeds"] = embeddings(decoder_input_ids)
            with torch.no_grad():
                model(**inputs)[0]

    def test_input_embeddings_support_forward_hook(self):
        config, inputs_dict = self.model_tester.prepare_config_and_inputs()
        for model_class in self.all_model_classes:
            model = model_class(config).to(torch_device).eval()
            base_model = model.model if hasattr(model, "model") else model
            hooks = []
            for stack_name in ("encoder", "decoder"):
                stack = getattr(base_model, stack_name, None)
                if stack is not None and hasattr(stack, "embed_tokens"):
                    hook = unittest.mock.MagicMock(return_value=None)
                    stack.embed_tokens.register_forward_hook(hook)
                    hooks.append(hook)
            model(**copy.deepcopy(self._prepare_for_class(inputs_dict, model_class)))
            self.assertGreater(sum(hook.call_count for hook in hooks), 0, model_class.__name__)

    @unittest.skip(
        reason="As for BART: the encoder and decoder always read the one shared embedding (tied by construction), "
        "so there is no untied variant to save and reload."
    )
    def test_load_save_without_tied_weights(self):
        pass

    def test_resize_embeddings_persists_embeddings_type(self):
        config, _ = self.model_tester.prepare_config_and_inputs()
        config.scale_embedding = True
        model = CoreformerSeq2SeqForConditionalGeneration(config)
        old_type = type(model.model.decoder.embed_tokens)
        model.resize_token_embeddings(new_num_tokens=config.vocab_size)
        self.assertIs(old_type, type(model.model.decoder.embed_tokens))

