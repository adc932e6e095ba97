"""THE list of native architectures, importable without torch: model_type -> the name help texts and docs print.

Each key is also the module of `coreformer.native` holding that architecture (`bert` -> native/bert.py), and the
order is export's order of preference within a family: `coreformer.native.NATIVE_ARCHITECTURES` is built from this
table, and the torch-free command line (coreformer_settings.registries) reads it for its help texts, so the names
are written once. Adding an architecture is its file and one line here.
"""

NATIVE_NAMES = {
    "bert": "BERT",
    "roberta": "RoBERTa",
    "gpt2": "GPT-2",
    "bart": "BART",
    "llama": "Llama",
    "mistral": "Mistral",  # before Qwen2: a model sliding on every layer is written as Mistral
    "qwen2": "Qwen2",
    "diffllama": "DiffLlama",
    "deepseek_v3": "DeepSeek-V3",
    "qwen3_next": "Qwen3-Next",
    "gpt_neox": "GPT-NeoX",
    "modernbert": "ModernBERT",
}
