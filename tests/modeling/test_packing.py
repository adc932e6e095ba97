"""Packed rows: several documents laid end to end in one row give each document exactly what it gets alone.

The contract, for every family (seq2seq: both sides, the decoder with its labels), layer type and CPU backend:
hidden states, logits, loss and gradients of a packed row equal those of its documents run one by one (fp32, 1e-5),
whether the packing is described by restarting position ids or by cu_seq_lens. Also: the kernels that keep their
cost on packed rows (sparse bands, linear scans, blocks restarting at each document, LSH sorted by document) against
per-document runs where documents cross their chunks, what the attention function receives, and the refusal.
"""

import pytest
import torch
from tiny import EOS, VOCAB, tiny_model
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import coreformer as cf
from coreformer import sparse_attention
from coreformer.block_attention import block_attention, document_blocks
from coreformer.forward_plan import (
    document_ids_from_cu_seq_lens,
    document_ids_from_positions,
    packed_documents,
    positions_in_documents,
    varlen_kwargs,
)
from coreformer.linear_attention import elu_feature_map, linear_attention
from coreformer.lsh_attention import draw_rotations, hash_buckets, length_normalized, lsh_attention
from coreformer.sparse_attention import sliding_window_attention, strided_attention

LENGTHS = (5, 9, 3)  # encoder / decoder-only documents
TARGET_LENGTHS = (4, 6, 2)  # the seq2seq decoder's documents, answering LENGTHS' one by one
# Blocks of 4 and LSH chunks of 3 over documents of 5, 9 and 3: documents start mid-block and mid-chunk.
PARAMETERS = dict(
    sliding_window=2, stride=3, block_size=4, lsh_bucket_size=3, lsh_num_hashes=2, lsh_num_buckets=4, kv_lora_rank=6
)
PACKED_LAYER_TYPES = ("full", "sliding", "strided", "linear", "block", "lsh", "differential", "sigmoid", "mla")
HEADS = {
    "encoder": cf.CoreformerEncoderForMaskedLM,
    "decoder": cf.CoreformerDecoderForCausalLM,
    "seq2seq": cf.CoreformerSeq2SeqForConditionalGeneration,
}


def documents(lengths: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (1, length), generator=generator) for length in lengths]


def restarting_positions(lengths: tuple[int, ...]) -> torch.Tensor:
    return torch.cat([torch.arange(length) for length in lengths])[None]  # (1, T)


def cu_seq_lens(lengths: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def document_inputs(family: str, index: int, sources: list, targets: list) -> dict:
    """The inputs of one document alone, with its labels (random -100s for the encoder's masked positions)."""
    ids = sources[index]
    if family == "encoder":
        labels = ids.masked_fill(torch.arange(ids.shape[1])[None] % 3 == 1, -100)
        return dict(input_ids=ids, labels=labels)
    if family == "decoder":
        return dict(input_ids=ids, labels=ids)
    labels = targets[index]
    decoder_input_ids = torch.cat([torch.full((1, 1), EOS), labels[:, :-1]], 1)  # tiny_config's decoder start
    return dict(input_ids=ids, labels=labels, decoder_input_ids=decoder_input_ids)


def packed_inputs(family: str, alone: list[dict], described_by: str) -> dict:
    """The documents end to end in one row, described by restarting position ids or by cu_seq_lens."""
    packed = {name: torch.cat([inputs[name] for inputs in alone], 1) for name in alone[0]}
    if family == "decoder":
        # Each document's first token is not a target of the previous document's last one (as
        # DataCollatorWithFlattening marks it).
        packed["labels"] = torch.cat([inputs["labels"].index_fill(1, torch.tensor([0]), -100) for inputs in alone], 1)
    sources = tuple(inputs["input_ids"].shape[1] for inputs in alone)
    targets = tuple(inputs["labels"].shape[1] for inputs in alone)
    if described_by == "positions":
        packed["position_ids"] = restarting_positions(sources)
        if family == "seq2seq":
            packed["decoder_position_ids"] = restarting_positions(targets)
        return packed
    queries, keys = (targets, sources) if family == "seq2seq" else (sources, sources)
    return packed | dict(
        cu_seq_lens_q=cu_seq_lens(queries),
        cu_seq_lens_k=cu_seq_lens(keys),
        max_length_q=max(queries),
        max_length_k=max(keys),
    )


def labelled(family: str, inputs: dict) -> int:
    """How many targets the loss of these inputs averages over."""
    labels = inputs["labels"]
    return int((labels[:, 1:] if family == "decoder" else labels).ne(-100).sum())


def hidden_states(family: str, outputs) -> tuple[torch.Tensor, ...]:
    if family == "seq2seq":
        return outputs.encoder_hidden_states + outputs.decoder_hidden_states
    return outputs.hidden_states


def packed_and_alone(
    family: str,
    layer_type: str,
    backend: str,
    described_by: str,
    gradients: bool = True,
    alone_backend: str | None = None,
    beside: str | None = None,
):
    """(packed run, per-document runs joined): hidden states, logits, loss, gradients of each (none without
    `gradients`). Both layers are `layer_type`, or the second is `beside`. The documents alone run under
    `alone_backend` where given, else under `backend` too."""
    overrides = dict(layer_types=[layer_type, beside or layer_type], **PARAMETERS)
    if family == "seq2seq":
        overrides["decoder_layer_types"] = [layer_type] * 2
    model = tiny_model(HEADS[family], family, **overrides)
    sources, targets = documents(LENGTHS, seed=1), documents(TARGET_LENGTHS, seed=2)
    alone = [document_inputs(family, index, sources, targets) for index in range(len(LENGTHS))]
    total = sum(labelled(family, inputs) for inputs in alone)
    runs = []
    for batches, weights, implementation in (
        ([packed_inputs(family, alone, described_by)], [1.0], backend),
        # the packed mean, document by document
        (alone, [labelled(family, inputs) / total for inputs in alone], alone_backend or backend),
    ):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        with torch.set_grad_enabled(gradients):
            outputs = [model(**inputs, output_hidden_states=True) for inputs in batches]
        loss = sum(weight * output.loss for weight, output in zip(weights, outputs))
        if gradients:
            loss.backward()
        states = [torch.cat(layer, 1) for layer in zip(*(hidden_states(family, output) for output in outputs))]
        logits = torch.cat([output.logits for output in outputs], 1)
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        runs.append((states, logits.detach(), loss.detach(), grads))
    return runs


def assert_same(packed, alone) -> None:
    (states, logits, loss, grads), (states_alone, logits_alone, loss_alone, grads_alone) = packed, alone
    for layer, (ours, reference) in enumerate(zip(states, states_alone)):
        torch.testing.assert_close(ours.detach(), reference.detach(), atol=1e-5, rtol=1e-5, msg=f"hidden {layer}")
    torch.testing.assert_close(logits, logits_alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, loss_alone, atol=1e-5, rtol=1e-5)
    assert grads.keys() == grads_alone.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_alone[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("described_by", ["positions", "cu_seq_lens"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("layer_type", PACKED_LAYER_TYPES)
@pytest.mark.parametrize("family", sorted(HEADS))
def test_packed_row_gives_each_document_what_it_gets_alone(family, layer_type, backend, described_by):
    assert_same(*packed_and_alone(family, layer_type, backend, described_by))


@pytest.mark.parametrize("described_by", ["positions", "cu_seq_lens"])
def test_packed_gated_deltanet_row_gives_each_document_what_it_gets_alone(described_by):
    # Decoders only, beside an attention layer (a stack of Gated DeltaNet alone would have no cache length).
    assert_same(*packed_and_alone("decoder", "gated_deltanet", "sdpa", described_by, beside="full"))


@pytest.mark.slow
def test_packed_row_gives_each_document_what_it_gets_alone_under_flex(flex_attention):
    # One case, against each document alone under eager: flex compiles a kernel per mask and length, and one packed
    # row is one length. Outputs and loss only: torch's flex_attention has no backward on CPU.
    packed_under_flex, alone_under_eager = packed_and_alone(
        "decoder", "sliding", "flex_attention", "positions", gradients=False, alone_backend="eager"
    )
    assert_same(packed_under_flex, alone_under_eager)


def test_documents_are_read_from_each_description():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    expected = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    assert torch.equal(document_ids_from_positions(positions), expected)
    assert document_ids_from_positions(torch.arange(9)[None]) is None  # one document per row: nothing to separate
    cu = torch.tensor([0, 3, 5, 9, 11, 18], dtype=torch.int32)  # two rows of 9, the second holding 2 documents
    rows = document_ids_from_cu_seq_lens(cu, batch=2, length=9)
    assert torch.equal(rows, torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 0, 1, 1, 1, 1, 1, 1, 1]]))
    assert torch.equal(positions_in_documents(rows)[0], positions[0])
    assert varlen_kwargs(rows)["cu_seq_lens_q"].tolist() == cu.tolist()
    assert varlen_kwargs(rows)["max_length_k"] == 7
    with pytest.raises(ValueError, match="ending at 18"):
        document_ids_from_cu_seq_lens(cu[:-1], batch=2, length=9)


def test_seq_idx_describes_packing_too():
    model = tiny_model(cf.CoreformerDecoderModel, "decoder", layer_types=["sliding", "linear"], **PARAMETERS)
    sources = documents(LENGTHS, seed=3)
    seq_idx = torch.cat([torch.full((length,), index) for index, length in enumerate(LENGTHS)])[None]
    with torch.no_grad():
        packed = model(torch.cat(sources, 1), seq_idx=seq_idx).last_hidden_state
        alone = torch.cat([model(ids).last_hidden_state for ids in sources], 1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_sparse_kernels_run_on_packed_rows_without_a_dense_mask():
    # The point of the kernels: O(L·w) on packed rows too, no T x T mask built for them.
    model = tiny_model(
        cf.CoreformerDecoderModel,
        "decoder",
        layer_types=["sliding", "strided", "block"],
        num_hidden_layers=3,
        **PARAMETERS,
    )
    stack = model.decoder
    ids = torch.cat(documents(LENGTHS, seed=4), 1)
    positions = restarting_positions(LENGTHS)
    hidden = stack.embed(ids, None, None, positions)
    found = packed_documents(ids, None, None, positions, {})
    plan = stack.planner.plan(
        hidden, None, None, positions, None, None, output_attentions=False, padded_states=False, documents=found
    )
    for name in ("sliding", "strided", "block"):
        assert plan.layers[name].kernel and plan.layers[name].mask is None
        assert torch.equal(plan.layers[name].documents, found)


def _per_document(function, query, key, value, lengths, **kwargs):
    """Run `function` on each document's slice of (B, H, T, D) tensors alone; outputs (B, T, H, D) joined."""
    outputs, start = [], 0
    for length in lengths:
        part = slice(start, start + length)
        outputs.append(function(query[:, :, part], key[:, :, part], value[:, :, part], **kwargs))
        start += length
    return torch.cat(outputs, 1)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("pattern", ["sliding", "strided"])
def test_sparse_kernels_keep_documents_apart_across_chunks(pattern, causal, fused, monkeypatch):
    # Chunks of 4 queries over documents of 5, 9 and 3: documents start mid-chunk and bands reach across them.
    if not fused:  # the sdpa/autograd path that GPUs and attention dropout take
        monkeypatch.setattr(sparse_attention, "_fused_kernels_apply", lambda query, dropout: False)
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 2, 17, 8, generator=generator, requires_grad=True) for _ in range(3))
    lengths = [(5, 9, 3), (2, 11, 4)]
    documents_ids = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths])
    if pattern == "sliding":
        function, parameter = sliding_window_attention, dict(window=3)
    else:
        function, parameter = strided_attention, dict(stride=3)
    shared = dict(causal=causal, padding_mask=None, scaling=0.3, chunk_size=4, **parameter)
    packed = function(query, key, value, documents=documents_ids, **shared)
    alone = torch.cat(
        [
            _per_document(
                function, query[row : row + 1], key[row : row + 1], value[row : row + 1], lengths[row], **shared
            )
            for row in range(2)
        ]
    )
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(packed.square().sum(), (query, key, value))
    expected = torch.autograd.grad(alone.square().sum(), (query, key, value))
    for grad, reference in zip(grads, expected):
        torch.testing.assert_close(grad, reference, atol=1e-5, rtol=1e-5)


def _assert_packed_equals_alone(attend, causal: bool) -> None:
    """`attend(query, key, value, documents)` over two packed rows of documents that start mid-chunk (chunks of 3
    or 4) against each document alone: outputs and gradients."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 2, 17, 8, generator=generator, requires_grad=True) for _ in range(3))
    lengths = [(5, 9, 3), (2, 11, 4)]
    documents_ids = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths])
    packed = attend(query, key, value, documents_ids)
    alone = torch.cat(
        [
            _per_document(attend, query[row : row + 1], key[row : row + 1], value[row : row + 1], lengths[row])
            for row in range(2)
        ]
    )
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(packed.square().sum(), (query, key, value))
    expected = torch.autograd.grad(alone.square().sum(), (query, key, value))
    for grad, reference in zip(grads, expected):
        torch.testing.assert_close(grad, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_blocks_restart_at_each_document(causal):
    # Blocks of 4 over documents of 5, 9 and 3: each document counts its blocks from its own first token.
    def attend(query, key, value, documents=None):
        return block_attention(
            query, key, value, block_size=4, causal=causal, padding_mask=None, scaling=0.3, documents=documents
        )

    _assert_packed_equals_alone(attend, causal)
    ids = torch.tensor([[0] * 6 + [1] * 5 + [2] * 2])
    assert document_blocks(ids, 4).tolist() == [[1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 4, 5, 5]]


@pytest.mark.parametrize("num_hashes", [1, 2])
@pytest.mark.parametrize("causal", [True, False])
def test_lsh_hashes_sorts_and_chunks_each_document_alone(causal, num_hashes):
    # Chunks of 3 over documents of 5, 9 and 3, 4 buckets: a chunk and the one before hold several documents.
    rotations = draw_rotations(2, 8, num_hashes, 4, seed=1)

    def attend(query, key, value, documents=None):
        shared_key = length_normalized(key)  # the layer's keys: its queries, length-normalised
        return lsh_attention(
            query,
            shared_key,
            value,
            hash_buckets(shared_key, rotations),
            num_buckets=4,
            bucket_size=3,
            causal=causal,
            padding_mask=None,
            scaling=0.3,
            documents=documents,
        )

    _assert_packed_equals_alone(attend, causal)


@pytest.mark.parametrize("causal", [True, False])
def test_linear_attention_restarts_its_state_at_each_document(causal):
    # Chunks of 4 over documents of 5, 9 and 3 (second row 2, 11, 4): the state must empty mid-chunk.
    def attend(q, k, v, documents=None):
        return linear_attention(
            elu_feature_map(q), elu_feature_map(k), v, causal=causal, chunk_size=4, documents=documents
        )[0]

    _assert_packed_equals_alone(attend, causal)


def test_lowrank_layers_refuse_packed_rows():
    # Linformer projects the whole sequence along its length: documents would mix.
    model = tiny_model(cf.CoreformerEncoderModel, "encoder", layer_types=["lowrank", "full"], lowrank_k=6)
    ids = torch.cat(documents(LENGTHS, seed=5), 1)
    with pytest.raises(ValueError, match="'lowrank' layers cannot keep apart.*own row"):
        model(ids, position_ids=restarting_positions(LENGTHS))
    with pytest.raises(ValueError, match="'lowrank' layers cannot keep apart"):
        model(ids, cu_seq_lens_q=cu_seq_lens(LENGTHS), cu_seq_lens_k=cu_seq_lens(LENGTHS))
    model(ids, position_ids=torch.arange(ids.shape[1])[None])  # one document per row is fine


def test_packed_rows_refuse_a_cache_and_one_sided_seq2seq_packing():
    model = tiny_model(cf.CoreformerDecoderForCausalLM, "decoder")
    ids = torch.cat(documents(LENGTHS, seed=6), 1)
    with pytest.raises(ValueError, match="a cache cannot continue.*use_cache=False"):
        model(ids, position_ids=restarting_positions(LENGTHS), use_cache=True)
    assert model(ids, position_ids=restarting_positions(LENGTHS)).past_key_values is None  # no cache by default
    seq2seq = tiny_model(cf.CoreformerSeq2SeqForConditionalGeneration, "seq2seq")
    with pytest.raises(ValueError, match="encoder side .* packs .* decoder side does not"):
        seq2seq(ids, decoder_input_ids=ids[:, :4], position_ids=restarting_positions(LENGTHS), use_cache=False)
    with pytest.raises(ValueError, match="seq_idx describes the documents of one sequence"):
        seq2seq(ids, decoder_input_ids=ids[:, :4], seq_idx=torch.zeros_like(ids))


def test_attention_function_receives_positions_and_varlen_arguments(monkeypatch):
    # As transformers' Llama: position ids reach the attention function; under flash (which reads no mask) the
    # varlen arguments are derived from them when the caller did not pass them.
    received = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        received.append(kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "recording_flash_attention", recording)
    assert "recording_flash_attention" not in ALL_MASK_ATTENTION_FUNCTIONS  # a flash-like function reads no mask
    model = tiny_model(cf.CoreformerDecoderModel, "decoder")
    model.config._attn_implementation = "recording_flash_attention"
    ids = torch.cat(documents(LENGTHS, seed=7), 1)
    positions = restarting_positions(LENGTHS)
    with torch.no_grad():
        model(ids, position_ids=positions)
    assert len(received) == 2  # one call per layer
    for kwargs in received:
        assert torch.equal(kwargs["position_ids"], positions)
        assert kwargs["cu_seq_lens_q"].tolist() == kwargs["cu_seq_lens_k"].tolist() == [0, 5, 14, 17]
        assert kwargs["max_length_q"] == kwargs["max_length_k"] == 9
    received.clear()
    with torch.no_grad():
        model(ids)  # one document: positions only
    assert all("cu_seq_lens_q" not in kwargs and kwargs["position_ids"].shape == (1, 17) for kwargs in received)


def test_seq2seq_under_flash_pairs_each_sides_documents_in_the_varlen_arguments(monkeypatch):
    # Flash reads no mask: each self-attention gets its own side's documents, cross-attention decoder document i
    # against encoder document i; a caller's cu_seq_lens_q/k (which describe the two sides) never reach a
    # self-attention as its own.
    received = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        received.append((module.is_cross_attention, module.is_causal, kwargs))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "recording_flash_attention", recording)
    model = tiny_model(cf.CoreformerSeq2SeqModel, "seq2seq", encoder_layers=1, decoder_layers=1)
    model.config._attn_implementation = "recording_flash_attention"
    sources, targets = documents(LENGTHS, seed=9), documents(TARGET_LENGTHS, seed=10)
    for described_by in ("positions", "cu_seq_lens"):
        alone = [dict(input_ids=s, decoder_input_ids=t, labels=t) for s, t in zip(sources, targets)]
        packed = packed_inputs("seq2seq", alone, described_by)
        packed.pop("labels")
        received.clear()
        with torch.no_grad():
            model(**packed, use_cache=False)
        (encoder,), (decoder,), (cross,) = (
            [kwargs for is_cross, causal, kwargs in received if (is_cross, causal) == kind]
            for kind in ((False, False), (False, True), (True, False))
        )
        assert encoder["cu_seq_lens_q"].tolist() == encoder["cu_seq_lens_k"].tolist() == [0, 5, 14, 17]
        assert decoder["cu_seq_lens_q"].tolist() == decoder["cu_seq_lens_k"].tolist() == [0, 4, 10, 12]
        assert cross["cu_seq_lens_q"].tolist() == [0, 4, 10, 12] and cross["cu_seq_lens_k"].tolist() == [0, 5, 14, 17]
        assert (cross["max_length_q"], cross["max_length_k"]) == (6, 9) and "position_ids" not in cross


@pytest.mark.parametrize("layer_type", ["sliding", "linear", "block", "lsh"])
def test_packed_attentions_are_each_documents_own(layer_type):
    # Recomputed probabilities (beside the sparse kernel under sdpa; the linear kernel's own) see the documents too.
    model = tiny_model(cf.CoreformerEncoderModel, "encoder", layer_types=[layer_type, "full"], **PARAMETERS)
    sources = documents(LENGTHS, seed=8)
    with torch.no_grad():
        packed = model(torch.cat(sources, 1), position_ids=restarting_positions(LENGTHS), output_attentions=True)
        alone = [model(ids, output_attentions=True).attentions for ids in sources]
    start = 0
    for index, length in enumerate(LENGTHS):
        rows = slice(start, start + length)
        for layer, attentions in enumerate(packed.attentions):
            block = attentions[:, :, rows]  # (1, H, length, T): this document's queries over the whole row
            torch.testing.assert_close(block[..., rows], alone[index][layer], atol=1e-5, rtol=1e-5)
            assert float(block.sum(-1).sub(1).abs().max()) < 1e-5  # nothing left for the other documents
        start += length
