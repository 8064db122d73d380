"""Document masking in the torch model: a packed window behaves as its documents run apart."""

import pytest
import torch

from setdiff_megatron.core.orders import Uniform
from setdiff_megatron.core.streams import sample_two_stream_batch
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from tests.conftest import debug_config

MASK, EOD = 63, 62


def _window() -> tuple[torch.Tensor, torch.Tensor]:
    """Two windows of three documents each (EOD-terminated), the second one padded at the end."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 60, (2, 14), generator=gen)
    tokens[:, [3, 9]] = EOD
    pad = torch.zeros_like(tokens, dtype=torch.bool)
    pad[1, 12:] = True
    return tokens, pad


@pytest.mark.parametrize("impl", ["dense", "fused"])
def test_each_document_is_computed_as_if_alone(impl):
    """Query logits of a document in the window equal those of the model run on that document's
    ranks only (same positions, same relative order)."""
    torch.manual_seed(0)
    model = SetDiffusionTransformer(debug_config(attention_impl=impl)).double()
    tokens, pad = _window()
    batch = sample_two_stream_batch(
        tokens, Uniform(), mask_token_id=MASK, pad_mask=pad, eod_id=EOD, generator=torch.Generator().manual_seed(1)
    )
    logits = model(batch.clean_tokens, batch.query_tokens, batch.position_ids, batch.valid_len, batch.document_ids)
    for row in range(2):
        real = torch.arange(14) < batch.valid_len[row]
        for doc in range(3):
            ranks = ((batch.document_ids[row] == doc) & real).nonzero()[:, 0]
            alone = model(*(t[row, ranks][None] for t in (batch.clean_tokens, batch.query_tokens, batch.position_ids)))
            torch.testing.assert_close(logits[row, ranks], alone[0], rtol=0, atol=1e-12)


def test_changing_one_document_changes_no_other():
    """New tokens in the second document leave the other documents' logits as they were, and
    leak into them without document ids."""
    torch.manual_seed(0)
    model = SetDiffusionTransformer(debug_config()).double()
    tokens, pad = _window()
    other = tokens.clone()
    other[:, 4:9] = (other[:, 4:9] + 1) % 60
    logits = {}
    for name, t in (("before", tokens), ("after", other)):
        batch = sample_two_stream_batch(
            t, Uniform(), mask_token_id=MASK, pad_mask=pad, eod_id=EOD, generator=torch.Generator().manual_seed(2)
        )
        args = (batch.clean_tokens, batch.query_tokens, batch.position_ids, batch.valid_len)
        logits[name], logits[name + "_crossing"] = model(*args, batch.document_ids), model(*args)
    kept = batch.document_ids != 1
    torch.testing.assert_close(logits["after"][kept], logits["before"][kept], rtol=0, atol=1e-12)
    assert (logits["after"][~kept] - logits["before"][~kept]).abs().amax() > 1e-3
    assert (logits["after_crossing"][kept] - logits["before_crossing"][kept]).abs().amax() > 1e-3
